"""Where a request's time to first token went, from the client's clock and the server's log.

The sweep starts ``kvengine serve --request-timing-log FILE`` (``server.request_timing_log``)
and the load sends each request with a ``request_id``; ``join`` finds each record's line in the
file (by the response id, which carries the request id) and gives the record its phases in ms,
which add up to the TTFT the client measured (client and server share the host's monotonic
clock):

- ``to_server``: the client's send to the handler having the parsed body (the client's request
  building, the wire, the server's HTTP parsing and body validation);
- ``to_engine``: tokenizing, checks, the engine taking it;
- ``queued``: waiting to be scheduled (the store's lookup included, with offload);
- ``prefill``: its first step to its first token;
- ``to_loop``: the engine's first token to the server's loop making it a chunk;
- ``to_client``: that chunk to the client reading its content.

``queued`` is cut further where the engine stamped it (``QUEUED_PARTS``, in
``record["server_queued"]``): ``to_take`` (the engine's step thread taking it), then for a
restored request ``to_send`` (its store round trip sent), ``restore`` (sent to its load having
landed), ``to_ready`` (the step seeing it landed) and ``to_schedule``; for the others
``to_schedule`` from being taken.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PHASES = ("to_server", "to_engine", "queued", "prefill", "to_loop", "to_client")
QUEUED_PARTS = ("to_take", "to_send", "restore", "to_ready", "to_schedule")
_STAMPS = ("received", "added", "scheduled", "first_token", "first_token_seen")


def read_log(path: Path) -> dict[str, dict]:
    """The log's lines by response id (a line that does not parse is skipped)."""
    rows: dict[str, dict] = {}
    if not path.is_file():
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("id"), str):
                rows[row["id"]] = row
    return rows


def phases_ms(record: dict, row: dict) -> dict[str, float] | None:
    """The record's TTFT cut into ``PHASES`` (ms), or None when a stamp is missing."""
    sent, ttft = record.get("sent_clock_s"), record.get("ttft_s")
    stamps = [row.get(k) for k in _STAMPS]
    if not _numbers([sent, ttft, *stamps]):
        return None
    times = [sent, *stamps, sent + ttft]
    return {name: 1e3 * (b - a) for name, a, b in zip(PHASES, times, times[1:])}


def queued_parts_ms(row: dict) -> dict[str, float] | None:
    """The ``queued`` phase cut into ``QUEUED_PARTS`` (ms; only the parts that apply), or None
    when the engine did not stamp it (or a stamp is not a number: a line edited by hand)."""
    added, taken, scheduled = row.get("added"), row.get("taken"), row.get("scheduled")
    restore = row.get("restore")
    if not _numbers([added, taken, scheduled]) or restore is not None and not (
            isinstance(restore, list) and len(restore) == 3 and _numbers(restore)):
        return None
    stamps = ([("to_take", added), ("to_send", taken), ("restore", restore[0]),
               ("to_ready", restore[1]), ("to_schedule", restore[2])] if restore
              else [("to_take", added), ("to_schedule", taken)])
    ends = [t for _, t in stamps[1:]] + [scheduled]
    return {name: 1e3 * (end - start) for (name, start), end in zip(stamps, ends)}


def _numbers(values: list) -> bool:
    """Every value is an int or a float (a JSON number; not a bool, not None)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def join(records: list[dict], path: Path, id_prefix: str = "chatcmpl-") -> int:
    """Give each record found in the log at ``path`` its ``server`` phases; how many were."""
    rows = read_log(path)
    found = 0
    for record in records:
        rid = record.get("request_id")
        row = rows.get(id_prefix + rid) if rid else None
        record["server"] = phases_ms(record, row) if row is not None else None
        record["server_queued"] = queued_parts_ms(row) if row is not None else None
        found += record["server"] is not None
    return found


def mean_phases(records: list[dict]) -> dict[str, float] | None:
    """Mean ms per phase over the records that have them (None if none has)."""
    timed = [r["server"] for r in records if r.get("server")]
    if not timed:
        return None
    return {name: statistics.fmean(t[name] for t in timed) for name in PHASES}


def mean_queued_parts(records: list[dict]) -> dict[str, float] | None:
    """Mean ms per part of ``queued`` over the records that have it (a part missing from a
    record counts as 0 there); None if none has."""
    timed = [r["server_queued"] for r in records if r.get("server_queued")]
    if not timed:
        return None
    return {name: statistics.fmean(t.get(name, 0.0) for t in timed) for name in QUEUED_PARTS
            if any(name in t for t in timed)}
