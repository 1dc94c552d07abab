"""Fleet analytics over trace journals (docs/trace.md), as PySpark jobs; definitions in docs/analytics.md.

Theory of operation
-------------------
Routers write one JSON line per routing decision. ``upsycle-router compact`` turns any number of journals
into one Parquet table (bad lines kept and marked, never fatal); ``upsycle-router analyze`` does that and
then computes the fleet figures (per-group delivery, duplicates, amplification and latency, the expected
deliveries that were lost and the cause of each, drops, expiry, queue residency, why messages were not
delivered) as Parquet tables, ``summary.json`` and a self-contained ``report.html``. The modules, in data-flow order:

* :mod:`.session`: finding Java and starting a Spark session that stays on loopback;
* :mod:`.rules`: the record layout and the rules that make a line bad, as plain data;
* :mod:`.schema`: the same as Spark column expressions (the reference parse);
* :mod:`.arrowparse`: the same with Arrow, for local journals (the fast parse, in worker processes);
* :mod:`.sources`: finding journals, numbering their lines, compacting them;
* :mod:`.stats`: the metrics as lazy DataFrame transformations;
* :mod:`.job`: the stages of the two jobs and their outputs;
* :mod:`.report`: ``summary.json``, ``report.html`` and the text summary, in plain Python.

This package imports PySpark only in the modules that need it (not :mod:`.session` or this one), so the CLI
can register its subcommands without loading Spark.
"""

from __future__ import annotations
