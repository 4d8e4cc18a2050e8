"""One rank's committed versions in its node's memory: files that outlive the processes (tier 2).

With ``Config.node_store`` set (the launcher sets it for jobs that span hosts),
the store keeps this rank's own payload and the copies it holds for others in
files under ``<node_store>/L<logical rank>/`` -- ``/dev/shm``: memory, not
storage -- mapped into the process, so that keeping them costs no extra copy.
Each version has a manifest (JSON: the job, the version, its layout, the
sizes, every piece with its chunks' checksums), written before the commit's
vote; the other versions' files go after the vote. So when the runtime ends
every process of the job (a node lost), each surviving node holds, for every
rank it ran, the voted version or the one before it, and a relaunch attaches
them. A file of another job is never read: the job is in the directory's name
and in every manifest, and the checksums catch the rest.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np


class NodeFiles:
    """This rank's directory of versions in node memory (local: no communication)."""

    def __init__(self, root: str, logical: int) -> None:
        self.root = Path(root)
        self.job = self.root.name
        self.dir = self.root / f"L{logical}"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir.mkdir(mode=0o700, exist_ok=True)

    def create(self, version: int, kind: str, nbytes: int) -> np.ndarray:
        """A fresh array of ``nbytes`` backed by file ``v<version>.<kind>`` (shared mapping)."""
        path = self.dir / f"v{version}.{kind}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            return _mapped(fd, nbytes)
        finally:
            os.close(fd)

    def open(self, version: int, kind: str, nbytes: int) -> np.ndarray | None:
        """The array kept in ``v<version>.<kind>``, or None when it is missing or of another size."""
        path = self.dir / f"v{version}.{kind}"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            return _mapped(fd, nbytes) if os.fstat(fd).st_size == nbytes else None
        finally:
            os.close(fd)

    def seal(self, version: int, manifest: dict[str, Any]) -> None:
        """Write version ``version``'s manifest, whole or not at all (a rename)."""
        path = self.dir / f"v{version}.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps({"job": self.job, "version": version, **manifest}))
        tmp.replace(path)

    def retire(self, keep: int | None) -> None:
        """Remove every version's files but ``keep``'s (the mapped ones stay readable until unmapped)."""
        for path in self.dir.iterdir():
            if keep is None or not path.name.startswith(f"v{keep}."):
                path.unlink(missing_ok=True)

    def prune(self, keep: set[int]) -> None:
        """Remove the directories of logical ranks other than ``keep`` (the node's ranks now): a
        rank whose process died here, its state since committed elsewhere (local)."""
        for path in self.root.glob("L*"):
            if path.name[1:].isdigit() and int(path.name[1:]) not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def manifests(self) -> list[dict[str, Any]]:
        """This rank's sealed versions of this job on this node, newest first."""
        found = []
        for path in self.dir.glob("v*.json"):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # half-written by a process that died: its version is not here
            if isinstance(doc, dict) and doc.get("job") == self.job and isinstance(doc.get("version"), int):
                found.append(doc)
        return sorted(found, key=lambda d: -d["version"])

    def remove(self) -> None:
        """The job is over: this rank's files go, and the job's directory once it is empty."""
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.root.rmdir()
        except OSError:
            pass  # another rank's files are still there: the last one removes it


def _mapped(fd: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)
