"""What the Ray tests share, done before Ray is imported.

Ray 2.60 clusters started with ``ray start`` (and ``ray.cluster_utils.Cluster``)
authenticate by token, and a driver that joins one sends the token only when
``RAY_AUTH_MODE=token`` is set when Ray is imported. A fresh machine has no token
yet: ``ray get-auth-token --generate`` writes one to ``~/.ray/auth_token`` (its
output, the token, is not printed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


def prepare() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if not token.is_file() and Path(RAY).is_file():
        subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=120)
