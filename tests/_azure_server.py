"""A real Azure Blob server for tests: Microsoft's Azurite emulator on a free loopback port.

Azurite is an npm package; ``bash tools/install.sh --test`` installs it into ``.test-tools/``
of the repository when npm is there. It serves the well-known development account
(``devstoreaccount1`` and its published key), path-style: a container is
``http://127.0.0.1:PORT/devstoreaccount1/CONTAINER``. obstore reaches it with an explicit
``endpoint`` (its ``use_emulator`` switch only knows the default port), so these tests use the
same ``storage_options`` a user of any Azure-compatible endpoint would pass.

Like the S3 server, it runs in its own session, dies with the process that started it and is
stopped at exit; its telemetry is off (this machine has no outside network).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import urllib.error
import urllib.request
from email.utils import formatdate
from pathlib import Path
from typing import Any

from _server_process import Emulator, free_port

ACCOUNT = "devstoreaccount1"
# Azurite's published development key (not a secret: it is in Microsoft's documentation).
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_API_VERSION = "2021-08-06"
_REPO = Path(__file__).resolve().parent.parent


def find_azurite() -> str | None:
    """Path of ``azurite-blob``: $FASTLOAD_AZURITE, the repo's .test-tools/, then $PATH."""
    explicit = os.environ.get("FASTLOAD_AZURITE")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    local = _REPO / ".test-tools" / "node_modules" / ".bin" / "azurite-blob"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("azurite-blob")



class AzureServer(Emulator):
    """``azurite-blob`` on 127.0.0.1; ``create_container`` gives an ``az://`` URL."""

    def __init__(self, *, binary: str | None = None, startup_timeout: float = 60.0):
        binary = binary or find_azurite()
        if binary is None:
            raise FileNotFoundError("Azurite not found: bash tools/install.sh --test installs it (needs npm)")
        super().__init__(binary, "azurite", startup_timeout)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What a user passes for an Azure-compatible endpoint: account, key, endpoint, plain HTTP."""
        return {"account_name": ACCOUNT, "access_key": ACCOUNT_KEY, "endpoint": self.endpoint, "allow_http": True}

    def start(self) -> AzureServer:
        if self.running:
            return self
        self.port = free_port()
        self._launch([self.binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                      "--location", str(self.data_dir / "data"), "--skipApiVersionCheck", "--loose",
                      "--disableTelemetry", "--silent"],
                     self.endpoint + "?comp=list")  # 403 for an unsigned request: it is up
        return self

    def create_container(self, name: str) -> str:
        """Create container ``name`` (a SharedKey-signed Create Container call; obstore has
        none) and return ``az://name``."""
        date = formatdate(usegmt=True)
        ctype = "application/octet-stream"
        # Verb, 11 standard headers (only Content-Type set), canonical x-ms headers, resource.
        fields = ["PUT", "", "", "", "", ctype, "", "", "", "", "", ""]
        to_sign = "\n".join(fields) + f"\nx-ms-date:{date}\nx-ms-version:{_API_VERSION}\n/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        sig = base64.b64encode(hmac.new(base64.b64decode(ACCOUNT_KEY), to_sign.encode(), hashlib.sha256).digest())
        req = urllib.request.Request(
            f"{self.endpoint}/{name}?restype=container", method="PUT", data=b"",
            headers={"x-ms-date": date, "x-ms-version": _API_VERSION, "Content-Type": ctype,
                     "Authorization": f"SharedKey {ACCOUNT}:{sig.decode()}"},
        )
        try:
            urllib.request.urlopen(req, timeout=30).close()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists already
                raise RuntimeError(f"creating container {name}: HTTP {exc.code} {exc.read()[:300]!r}") from exc
        return f"az://{name}"
