"""Finding journals, reading them into the compacted event table, and writing that table as Parquet.

Theory of operation
-------------------
An input is either a compacted table (a Parquet file, or a directory whose name ends in ``.parquet`` or that
holds ``*.parquet`` parts directly) or journals: a ``trace-*.jsonl`` file, or a directory searched
recursively for them, so one can point the job at a directory holding the journal directories of a whole
fleet. For local paths :func:`discover` sorts that out in Python before Spark starts, so an empty or mistyped
path is a clear error and not an empty analysis; below the given directory it skips what Spark's listing of
a URI skips (:func:`hidden`: names starting with ``_`` or ``.``, Hadoop's hidden files) and follows the
directories it follows (symbolic links), so a directory gives the same journals as a path and as a ``file://``
URI; a directory reached twice through a link is read once as a path, and refused as a URI (Spark would read
it twice). A URI
(:mod:`~upsycle_router.analytics.location`) is passed to Spark as it is: a name ending in ``.parquet`` is a
table, anything else is searched by Spark's reader for ``trace-*.jsonl`` files (``recursiveFileLookup`` with
``pathGlobFilter``).

:func:`read_journals` reads the journal files as text, **once**, and turns each line into one row of
:data:`~upsycle_router.analytics.schema.COMPACT_SCHEMA`: the parsed fields (each line parsed once, see
:func:`~upsycle_router.analytics.schema.parse_lines`), plus ``file`` and ``line`` (the 1-based line number
in its file) and, for a bad line, ``problem`` and ``text``. Spark's text reader knows a row's file but not
its line number. The read is planned with one whole file per task (:func:`whole_files`: split size and the
cost of opening a file set far above any journal's size, so Spark neither splits a file nor packs two into
one task; a journal is at most ``trace.max_bytes``, 64 MiB by default). Rows of a task then come in file
order and ``monotonically_increasing_id`` numbers them from 0 within the task, so the line number is that
count plus one: no second pass over the files and no join. A task that reads anything but the start of a
file fails the job (``raise_error``) rather than number lines wrongly. ``(ts, file, line)`` is the total
order the analysis uses to break ties between records with the same ``ts`` of one node: the order the
router wrote them. The number of tasks is the number of journal files. The text reader (Hadoop's line
reader) skips a UTF-8 byte-order mark at the start of a file, and only there; Arrow's parse does the same.

Compaction (:func:`compact`) writes that table to Parquet once; :func:`load_events` reads any mix of journals
and compacted tables into one DataFrame of the same shape. With a local master and a local output, local
journals are first offered to Arrow's parser (:mod:`~upsycle_router.analytics.arrowparse`, the fast twin of
:func:`read_journals`, proven equal to it by the tests), which writes the files it takes as Parquet parts
of the table; Spark then appends the rest (the odd lines of the files Arrow took, parsed by
:func:`~upsycle_router.analytics.schema.parse_lines` with their own line numbers; the files Arrow did not
take; journals at URIs; compacted tables) to the same table. :data:`ARROW_PARSE` turns the fast path off.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from upsycle_router.analytics.location import HadoopFiles, is_uri, name_of, no_glob, overlap, place, remove_local
from upsycle_router.analytics.schema import COMPACT_COLUMNS, COMPACT_SCHEMA, parse_lines
from upsycle_router.analytics.session import AnalyticsError, is_local_master

__all__ = [
    "ARROW_PARSE",
    "JOURNAL_GLOB",
    "Compaction",
    "Inputs",
    "arrow_parse_allowed",
    "compact",
    "discover",
    "hidden",
    "is_table",
    "load_events",
    "no_glob",
    "read_journals",
    "union_all",
]

JOURNAL_GLOB = "trace-*.jsonl"
ARROW_PARSE = "spark.upsycle.analytics.arrowParse"
"""Session setting: ``false`` leaves every journal to Spark's parser (the default, ``true``, offers local
journals to Arrow's first: :func:`compact`)."""
WHOLE_FILE = 1 << 40
"""Split size and file open cost while reading journals: larger than any journal, so one file per task."""
_ROW_BITS = 33
"""``monotonically_increasing_id`` is the task number shifted left by 33 bits plus the row's index in the task."""


@dataclass(frozen=True, slots=True)
class Inputs:
    """The journal files and compacted tables found under the given paths (local ones found in Python, URIs
    as given)."""

    journals: tuple[Path, ...]
    tables: tuple[Path, ...]
    journal_uris: tuple[str, ...] = ()
    table_uris: tuple[str, ...] = ()

    @property
    def journal_bytes(self) -> int:
        """Total size of the local journal files."""
        return sum(p.stat().st_size for p in self.journals)

    @property
    def has_journals(self) -> bool:
        """Whether there is anything to compact."""
        return bool(self.journals or self.journal_uris)

    @property
    def has_tables(self) -> bool:
        """Whether compacted tables were given."""
        return bool(self.tables or self.table_uris)

    def describe(self) -> str:
        """``4 journal files (1.2 MiB)``, plus the URIs searched for journals."""
        parts = []
        if self.journals:
            parts.append(f"{len(self.journals)} journal files ({_size(self.journal_bytes)})")
        if self.journal_uris:
            parts.append("journals under " + ", ".join(self.journal_uris))
        return " and ".join(parts)


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def is_table(path: str | Path) -> bool:
    """Whether ``path`` is a compacted (Parquet) table rather than journals (for a URI: by its name)."""
    if is_uri(path):
        return name_of(path).endswith(".parquet")
    path = Path(path)
    if path.suffix == ".parquet":
        return True
    return path.is_dir() and any(p.suffix == ".parquet" and p.is_file() for p in path.iterdir())


def hidden(name: str) -> bool:
    """Whether a directory listing by Spark skips the file or directory ``name`` (Spark's rule, after Hadoop's
    hidden files): a name starting with ``.``, or with ``_`` unless it holds ``=`` (a partition) or starts with
    ``_metadata`` or ``_common_metadata``, or ending in ``._COPYING_`` (a file being copied)."""
    if name.startswith(("_metadata", "_common_metadata")):
        return False
    return name.startswith(".") or (name.startswith("_") and "=" not in name) or name.endswith("._COPYING_")


def _walk_journals(top: Path, *, twice: bool = False) -> list[Path]:
    """The journal files in the directory ``top`` and below it, as Spark's listing finds them: hidden names
    skipped, directories reached through symbolic links followed (Hadoop's local file system follows them). A
    directory below it that cannot be listed or a journal name that is a link to nothing (both would be left
    out without a word) is refused. A directory or journal reached twice (through a link: ``latest ->
    2024-05-01``) is read once - or, with ``twice`` (``top`` is a ``file:`` URI's, which Spark lists: it would
    read it twice, or go round a loop), refused."""

    def unreadable(e: OSError) -> None:
        raise AnalyticsError(f"{e.filename}: cannot be read ({e.strerror}): its journals would be left out")

    seen: dict[str, str] = {}
    files_seen: dict[str, str] = {}
    found: list[Path] = []
    for root, dirs, files in os.walk(top, onerror=unreadable, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            if twice:
                raise AnalyticsError(f"{root}: the same directory as {seen[real]} (through a symbolic link): "
                                     "Spark would read its journals twice (give the directory as a path)")
            dirs[:] = []
            continue
        seen[real] = root
        dirs[:] = sorted(d for d in dirs if not hidden(d))
        for name in files:
            if not fnmatch.fnmatchcase(name, JOURNAL_GLOB) or hidden(name):
                continue
            full = Path(root) / name
            if full.is_symlink() and not full.exists():
                raise AnalyticsError(f"{full}: a symbolic link to nothing")
            if full.is_file():
                real_file = os.path.realpath(full)
                if twice and real_file in files_seen:
                    raise AnalyticsError(f"{full}: the same journal as {files_seen[real_file]} (through a symbolic "
                                         "link): Spark would read it twice (give the directory as a path)")
                files_seen.setdefault(real_file, str(full))
                found.append(full)
    return found


def _local_dir(uri: str) -> Path | None:
    """The local directory a ``file:`` URI names, if it is one (Spark lists it; we look for what it would read
    twice)."""
    if uri[:5].lower() != "file:":
        return None
    path = Path(place(uri))
    return path if path.is_dir() else None


def _utf8(path: Path) -> None:
    """Refuse a path that is not valid UTF-8 (its name holds bytes Python keeps as surrogates): Spark and its
    workers name files in UTF-8 and cannot read it."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise AnalyticsError(f"{shown}: the path is not valid UTF-8, which Spark cannot read: rename it") from None


def refuse_overwriting_inputs(inputs: Inputs, target: str | Path, what: str = "") -> None:
    """Refuse a ``target`` table that is one of the input tables, holds one or is inside one, by path or by
    ``file:`` URI (writing it would delete what is still to be read)."""
    here = place(target)
    tables: list[str | Path] = [*inputs.tables, *inputs.table_uris]
    for t in tables:
        if overlap(here, place(t)):
            raise AnalyticsError(f"{target}: is one of the inputs ({t}){what}")


def discover(paths: Iterable[str | Path]) -> Inputs:
    """Sort the given paths into journal files (found recursively) and compacted tables; URIs stay as given."""
    journals: list[Path] = []
    tables: list[Path] = []
    journal_uris: list[str] = []
    table_uris: list[str] = []
    given = [(str(raw), place(raw)) for raw in paths]
    for i, (a, where_a) in enumerate(given):
        for b, where_b in given[i + 1 :]:
            if (is_uri(a) or is_uri(b)) and overlap(where_a, where_b):
                # (local paths are read file by file, each once; a URI is Spark's to list: it would read both)
                raise AnalyticsError(f"{b}: the same place as {a}, or inside it or holding it: what is in both "
                                     "would be counted twice (give each input once)")  # fmt: skip
    for raw in paths:
        if is_uri(raw):
            if is_table(raw):
                table_uris.append(str(raw))
                continue
            local = _local_dir(str(raw))
            if local is not None:
                _walk_journals(local, twice=True)  # (refuses what Spark would read twice)
            journal_uris.append(str(raw))
            continue
        path = Path(raw)
        _utf8(path)
        if not path.exists():
            raise AnalyticsError(f"{path}: no such file or directory")
        if is_table(path):
            tables.append(path)
        elif path.is_file():
            journals.append(path)
        else:
            found = sorted(_walk_journals(path))
            for p in found:
                _utf8(p)
            if not found:
                raise AnalyticsError(
                    f"{path}: no {JOURNAL_GLOB} files in it or below it (names starting with _ or . are skipped)"
                )
            journals.extend(found)
    unique = sorted({p.resolve() for p in journals})
    return Inputs(
        journals=tuple(unique),
        tables=tuple(p.resolve() for p in tables),
        journal_uris=tuple(dict.fromkeys(journal_uris)),
        table_uris=tuple(dict.fromkeys(table_uris)),
    )


@contextmanager
def whole_files(spark: SparkSession) -> Iterator[None]:
    """While inside: file reads are planned with one whole file per task (the settings are restored after).

    Spark plans a file scan when an action runs, so the action that reads the journals must run inside.
    """
    keys = ("spark.sql.files.maxPartitionBytes", "spark.sql.files.openCostInBytes", "spark.sql.files.maxPartitionNum")
    old = {k: spark.conf.get(k, None) for k in keys}
    spark.conf.set(keys[0], str(WHOLE_FILE))
    spark.conf.set(keys[1], str(WHOLE_FILE))
    spark.conf.unset(keys[2])
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def _numbered(text: DataFrame) -> DataFrame:
    """``value``, ``_file`` and ``line`` of a text read planned by :func:`whole_files`."""
    first_row = F.col("_metadata.file_block_start") == 0
    index = F.monotonically_increasing_id().bitwiseAND(F.lit((1 << _ROW_BITS) - 1))
    line = F.when(first_row, index + 1).otherwise(
        F.raise_error(F.lit("a journal file was split between tasks; its line numbers would be wrong"))
    )
    return text.select(F.col("value"), F.col("_metadata.file_path").alias("_file"), line.cast("long").alias("line"))


def read_journals(spark: SparkSession, inputs: Inputs | Sequence[Path]) -> DataFrame:
    """The compacted event table of the given journal files (lazy: run its actions inside :func:`whole_files`)."""
    if not isinstance(inputs, Inputs):
        inputs = Inputs(journals=tuple(inputs), tables=())
    parts: list[DataFrame] = []
    if inputs.journals:
        parts.append(_numbered(spark.read.text([no_glob(p) for p in inputs.journals])))
    for uri in inputs.journal_uris:
        reader = spark.read.option("recursiveFileLookup", "true").option("pathGlobFilter", JOURNAL_GLOB)
        parts.append(_numbered(reader.text(uri)))
    if not parts:
        raise AnalyticsError("no journals to read")
    rows = union_all(parts)
    # Spark gives a URI (file:/a%20b/...): make a local one a path again; '+' is literal in a URI path.
    uri_path = F.regexp_replace(F.regexp_replace(F.col("_file"), "^file:(//)?", ""), "\\+", "%2B")
    rows = rows.select("value", F.url_decode(uri_path).alias("file"), "line")
    return parse_lines(rows, ["file", "line"]).select(*COMPACT_COLUMNS)


def union_all(parts: Sequence[DataFrame]) -> DataFrame:
    """The rows of all ``parts`` (at least one), matched by column name."""
    return functools.reduce(DataFrame.unionByName, parts)


def read_tables(spark: SparkSession, tables: Sequence[str | Path], *, trusted: bool = False) -> DataFrame:
    """The compacted event tables at the given paths, as one DataFrame.

    ``trusted`` tables were written by this package, so their schema is not read from the files (which costs
    a Spark job); other tables are checked for the columns of :data:`COMPACT_SCHEMA`.
    """
    if trusted:
        return spark.read.schema(COMPACT_SCHEMA).parquet(*[no_glob(p) for p in tables])
    try:
        df = spark.read.parquet(*[no_glob(p) for p in tables])
    except Exception as e:  # noqa: BLE001 - Spark's errors come as several classes; only these are the input's
        text = str(e)
        if not any(sign in text for sign in _NOT_PARQUET):
            raise
        cause = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
        raise AnalyticsError(f"{', '.join(map(str, tables))}: not a Parquet table ({cause[:300]})") from None
    missing = [c for c in COMPACT_COLUMNS if c not in df.columns]
    if missing:
        raise AnalyticsError(f"{', '.join(map(str, tables))}: not a compacted trace table (no {', '.join(missing)})")
    return df.select(*COMPACT_COLUMNS)


_NOT_PARQUET = ("UNABLE_TO_INFER_SCHEMA", "is not a Parquet file", "expected magic number")
"""What Spark's error says when a table given (a ``*.parquet`` name) holds no Parquet data: unusable input."""


def load_events(spark: SparkSession, inputs: Inputs) -> DataFrame:
    """Every row of the given journals and compacted tables (good and bad lines); journals read lazily, so run
    the actions inside :func:`whole_files`."""
    parts: list[DataFrame] = []
    if inputs.has_journals:
        parts.append(read_journals(spark, inputs))
    if inputs.has_tables:
        parts.append(read_tables(spark, [*inputs.tables, *inputs.table_uris]))
    if not parts:
        raise AnalyticsError("no input: give journal directories, trace-*.jsonl files or compacted tables")
    return union_all(parts)


def check_target(spark: SparkSession | None, out: str | Path) -> None:
    """Refuse to replace anything at ``out`` but a Parquet table (a directory of parts)."""
    if is_uri(out):
        if spark is None:
            return  # checked once Spark runs
        files = HadoopFiles(spark)
        uri = str(out)
        if files.exists(uri) and not (
            files.is_dir(uri) and all(n.startswith(("part-", "_", ".")) for n in files.names(uri))
        ):
            raise AnalyticsError(f"{out}: exists and is not a Parquet table; not replacing it")
        return
    path = Path(out)
    if path.exists() and not (path.is_dir() and all(p.name.startswith(("part-", "_", ".")) for p in path.iterdir())):
        raise AnalyticsError(f"{out}: exists and is not a Parquet table; not replacing it")


@dataclass(frozen=True, slots=True)
class Compaction:
    """How a compaction went: journal files parsed by Arrow and left to Spark (with the first reason why)."""

    arrow_files: int = 0
    spark_files: int = 0
    why_spark: str | None = None
    odd_lines: int = 0
    """Lines of the files Arrow took that Spark parsed (not single objects of at most 1,000 bytes)."""
    uris: int = 0
    """Journal URIs given: Spark lists and parses what they hold (not counted in the files here)."""

    def describe(self) -> str:
        """``198 journal files parsed by Arrow (3 odd lines of them by Spark), 2 by Spark (first: ...)``, and
        ``; the journals of 1 URI by Spark`` when URIs were given."""
        odd = f" ({self.odd_lines} odd lines of them by Spark)" if self.odd_lines else ""
        text = f"{self.arrow_files} journal files parsed by Arrow{odd}, {self.spark_files} by Spark"
        text += f" (first: {self.why_spark})" if self.why_spark else ""
        if self.uris:
            text += f"; the journals of {self.uris} URI{'s' if self.uris > 1 else ''} by Spark"
        return text


def arrow_parse_allowed(spark: SparkSession, inputs: Inputs, out: str | Path) -> str | None:
    """Why the journals of ``inputs`` must all be parsed by Spark, or None when Arrow may take them."""
    if not inputs.journals:
        return "no local journal files"
    if str(spark.conf.get(ARROW_PARSE, "true")).strip().lower() == "false":
        return f"{ARROW_PARSE} is false"
    if is_uri(out):
        return "the output is a URI"
    if not is_local_master(spark.sparkContext.master or ""):
        return "the master is not local"
    if importlib.util.find_spec("pyarrow") is None or importlib.util.find_spec("numpy") is None:
        return "pyarrow is not installed"
    return None


def compact(spark: SparkSession, inputs: Inputs, out: str | Path) -> Compaction:
    """Write the compacted event table of ``inputs`` to the Parquet directory ``out`` (replacing it).

    Local journals go to Arrow first (:mod:`~upsycle_router.analytics.arrowparse`: with a local master and a
    local ``out``, unless the session sets :data:`ARROW_PARSE` to ``false``); whatever it does not take,
    journals at URIs and compacted tables are written by Spark into the same table.
    """
    refuse_overwriting_inputs(inputs, out)
    why_not = arrow_parse_allowed(spark, inputs, out)
    if why_not is not None:
        with whole_files(spark):
            load_events(spark, inputs).write.mode("overwrite").parquet(str(out))
        return Compaction(spark_files=len(inputs.journals), why_spark=why_not if inputs.journals else None,
                          uris=len(inputs.journal_uris))
    from upsycle_router.analytics import arrowparse  # imports pyarrow: only when it is used

    target = Path(out)
    remove_local(target)  # what Spark's overwrite does (check_target made sure it is a table)
    target.mkdir(parents=True)
    results = arrowparse.compact_files(inputs.journals, target, spark.sparkContext.defaultParallelism)
    left = tuple(Path(r.path) for r in results if r.fallback)
    rest = Inputs(journals=left, tables=inputs.tables, journal_uris=inputs.journal_uris, table_uris=inputs.table_uris)
    odd = [(text, r.path, n) for r in results if not r.fallback for n, text in r.odd]
    parts: list[DataFrame] = []
    if rest.has_journals or rest.has_tables:
        parts.append(load_events(spark, rest))
    if odd:  # the lines Arrow left in the files it took: parsed by the same rules, with their own numbers
        lines = spark.createDataFrame(odd, "value string, file string, line long")
        parts.append(parse_lines(lines, ["file", "line"]).select(*COMPACT_COLUMNS))
    if parts:
        with whole_files(spark):
            union_all(parts).write.mode("append").parquet(str(out))
    else:
        arrowparse.finish_table(target)
    why = next((f"{Path(r.path).name}: {r.fallback}" for r in results if r.fallback), None)
    return Compaction(arrow_files=len(results) - len(left), spark_files=len(left), why_spark=why, odd_lines=len(odd),
                      uris=len(inputs.journal_uris))
