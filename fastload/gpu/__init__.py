"""Feeding the GPU: :mod:`.prefetcher` (CUDA-stream prefetch and on-device normalisation),
:mod:`.transforms` (batch flip / RandomResizedCrop / normalise on any device) and :mod:`.dali`
(a DALI pipeline over a pack; needs ``nvidia-dali-cuda120``). Nothing is imported here, so
``import fastload.gpu`` stays cheap and never imports DALI.
"""
