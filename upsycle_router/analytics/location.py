"""Where inputs and outputs live: local paths, or Spark/Hadoop URIs handed to Spark untouched.

Theory of operation
-------------------
A path given to ``analyze`` or ``compact`` is either *local* (no scheme: ``fleet/``, ``/var/log/trace``) or a
*URI* with a scheme Spark's Hadoop file system layer knows: ``file://``, ``hdfs://``, ``s3a://`` (the last
two need the cluster's Hadoop client and credentials, configured the usual Spark way, e.g. ``--conf
spark.hadoop.fs.s3a...``). :func:`is_uri` tells them apart by the ``scheme://`` prefix (or ``file:/``).

Local paths are checked and listed in Python before Spark starts, so a typo is a clear error at once, and
their names are escaped (:func:`no_glob`) so that Spark reads exactly those files. URIs are never rewritten:
the string the user gave is the string Spark's reader or writer gets (so Hadoop glob patterns in a URI work
as Hadoop defines them), and whatever this package writes itself next to the Parquet tables
(``summary.json``, ``report.html``) goes through the same Hadoop ``FileSystem`` as Spark's writers
(:class:`HadoopFiles`), reached through the session's JVM.
"""

from __future__ import annotations

import re
import shutil
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^file:/")


def is_uri(path: str | Path) -> bool:
    """Whether ``path`` is a URI for Spark (``s3a://b/x``, ``hdfs://nn/x``, ``file:///x``), not a local path."""
    return isinstance(path, str) and _URI.match(path) is not None


def place(path: str | Path) -> str:
    """Where ``path`` is, to tell whether two inputs, or an input and an output, are the same or one holds the
    other: a local path or a ``file:`` URI as the absolute path it names (symbolic links resolved), any other
    URI as its text without a trailing ``/``."""
    if is_uri(path):
        text = str(path)
        if text[:5].lower() != "file:":
            return text.rstrip("/")
        rest = re.sub(r"^file:(//[^/]*)?", "", text, flags=re.IGNORECASE)  # file:///x, file://localhost/x, file:/x
        return str(Path(urllib.parse.unquote(rest) or "/").resolve())
    return str(Path(path).resolve())


def overlap(a: str, b: str) -> bool:
    """Whether the places ``a`` and ``b`` (:func:`place`) are the same, or one holds the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def remove_local(path: Path) -> None:
    """Remove a local file, link or directory tree at ``path`` (a link itself, never what it points to); nothing
    there is no error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def join(base: str | Path, name: str) -> str:
    """``base/name`` for a local path or a URI (a URI keeps its text; one ``/`` between the two)."""
    if is_uri(base):
        return str(base).rstrip("/") + "/" + name
    return str(Path(base) / name)


def no_glob(path: str | Path) -> str:
    """A local path with Hadoop's glob characters escaped, so that Spark reads exactly that file.

    A URI is returned as it is: it is the user's, glob patterns included.
    """
    if is_uri(path):
        return str(path)
    return re.sub(r"([\\*?\[\]{}])", r"\\\1", str(path))


def name_of(path: str | Path) -> str:
    """The last component of a local path or a URI (``s3a://b/t.parquet/`` -> ``t.parquet``)."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


class HadoopFiles:
    """Files at URIs, through the Hadoop ``FileSystem`` of a running session (the one Spark's writers use)."""

    def __init__(self, spark: SparkSession) -> None:
        self._jvm: Any = spark.sparkContext._jvm
        self._conf: Any = spark.sparkContext._jsc.hadoopConfiguration()

    def _fs(self, uri: str) -> tuple[Any, Any]:
        path = self._jvm.org.apache.hadoop.fs.Path(uri)
        return path.getFileSystem(self._conf), path

    def exists(self, uri: str) -> bool:
        """Whether anything exists at ``uri``."""
        fs, path = self._fs(uri)
        return bool(fs.exists(path))

    def is_dir(self, uri: str) -> bool:
        """Whether ``uri`` is a directory."""
        fs, path = self._fs(uri)
        return bool(fs.exists(path) and fs.getFileStatus(path).isDirectory())

    def names(self, uri: str) -> list[str]:
        """The names in the directory ``uri``."""
        fs, path = self._fs(uri)
        return [str(status.getPath().getName()) for status in fs.listStatus(path)]

    def size(self, uri: str) -> int:
        """Total bytes of the files at or under ``uri``."""
        fs, path = self._fs(uri)
        return int(fs.getContentSummary(path).getLength())

    def delete(self, uri: str) -> None:
        """Remove whatever is at ``uri`` (a directory with everything in it); nothing there is no error."""
        fs, path = self._fs(uri)
        fs.delete(path, True)

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Create (or replace) the file ``uri`` with ``data``."""
        fs, path = self._fs(uri)
        stream = fs.create(path, True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()
