"""What the object-storage tests share: the small pack they upload and the augmentation they
compare loaders with (the local reference pack is conftest's ``local_pack``)."""

from __future__ import annotations

import fastload.transforms as T

AUG = T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip()])
# Small shards, so the sample tree's 24 images make several of them.
CFG = dict(payload="jpeg", resize=64, workers=1, progress=False, shard_size=6000)
