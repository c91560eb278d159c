"""A Redis job as the worker reads it: parsed and checked whole before anything runs, so no
content of a stream entry can raise out of the worker's loop.

    job = parse_job(fields, prefix="sandbox")   # a Job, or MalformedJob(reason)

The client (distributed.RedisSandbox) writes one stream field, `job`, a JSON object:

    op        "run" (default) | "session_open" | "session_run" | "session_close"
    code      str (run, session_run)             stdin    str (optional)
    timeout   seconds, a number (optional)       session  str (session_run, session_close)
    reply_to  "<prefix>:replies:<client>"        deadline unix time, a number: when the client gives up

Anything else is malformed and is dead-lettered on first sight with the reason: another or a
second stream field, bytes that are not UTF-8, an entry over MAX_JOB_CHARS, JSON that is not an
object (or nests past what the parser takes), a missing, unknown or mistyped key, a reply list
outside the prefix, a deadline already past or further than MAX_DEADLINE_S ahead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Mapping

MAX_JOB_CHARS = 4 * 1024 * 1024        # the whole JSON entry; the code limits come after (validate_request)
MAX_DEADLINE_S = 24 * 3600.0            # a deadline further ahead than this is no client's
OPS = {  # op -> (required keys, optional keys), besides reply_to and deadline
    "run": ({"code"}, {"op", "stdin", "timeout"}),
    "session_open": ({"op"}, {"timeout"}),
    "session_run": ({"op", "session", "code"}, {"stdin", "timeout"}),
    "session_close": ({"op", "session"}, {"timeout"}),
}
_TYPES = {"op": str, "code": str, "stdin": str, "session": str, "reply_to": str}


class MalformedJob(ValueError):
    """A stream entry that is not a job; the message is the reason."""


@dataclasses.dataclass(frozen=True)
class Job:
    op: str
    reply_to: str
    deadline: float
    code: str = ""
    stdin: str = ""
    timeout: float | None = None
    session: str = ""


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise MalformedJob(f"{what} must be text, got {type(value).__name__}")
    try:  # the worker's client decodes with surrogateescape: bytes that were not UTF-8 show up here
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedJob(f"{what} is not UTF-8") from None
    return value


def parse_job(fields: Mapping[Any, Any], prefix: str, now: float | None = None) -> Job:
    """The Job in a stream entry's fields; MalformedJob (never another exception) otherwise."""
    if set(fields) != {"job"}:
        raise MalformedJob(f"an entry has exactly one field, 'job'; got {sorted(map(repr, fields))[:8]}")
    raw = _text(fields["job"], "the job")
    if len(raw) > MAX_JOB_CHARS:
        raise MalformedJob(f"the job is {len(raw)} characters, over {MAX_JOB_CHARS}")
    try:
        d = json.loads(raw)
    except RecursionError:
        raise MalformedJob("the job's JSON nests deeper than the parser goes") from None
    except ValueError as e:
        raise MalformedJob(f"the job is not JSON: {str(e)[:200]}") from None
    if not isinstance(d, dict):
        raise MalformedJob(f"a job is a JSON object, got {type(d).__name__}")
    op = d.get("op", "run")
    if op not in OPS:
        raise MalformedJob(f"unknown op {str(op)[:50]!r} (ops: {', '.join(OPS)})")
    required, optional = OPS[op]
    required = required | {"reply_to", "deadline"}
    missing, extra = required - set(d), set(d) - required - optional
    if missing or extra:
        raise MalformedJob(f"op {op!r}: " + "; ".join(
            ([f"missing {', '.join(sorted(missing))}"] if missing else []) +
            ([f"unknown keys {', '.join(sorted(map(str, extra)))[:200]}"] if extra else [])))
    for key, _tp in _TYPES.items():
        if key in d:
            _text(d[key], key)
    if not d["reply_to"].startswith(f"{prefix}:replies:"):
        raise MalformedJob(f"reply_to {d['reply_to'][:80]!r} is not a reply list of {prefix!r}")
    numbers = {k: d.get(k) for k in ("deadline", "timeout") if d.get(k) is not None}
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MalformedJob(f"{key} must be a finite number, got {str(value)[:50]!r}")
    now = time.time() if now is None else now
    if d["deadline"] < now:
        raise MalformedJob(f"its deadline passed {now - d['deadline']:.1f} s before a worker took it")
    if d["deadline"] > now + MAX_DEADLINE_S:
        raise MalformedJob(f"its deadline is {d['deadline'] - now:.0f} s ahead, over {MAX_DEADLINE_S:.0f}")
    return Job(op=op, reply_to=d["reply_to"], deadline=float(d["deadline"]), code=d.get("code", ""),
               stdin=d.get("stdin", ""), timeout=numbers.get("timeout"), session=d.get("session", ""))


def reply_of(fields: Mapping[Any, Any], prefix: str) -> tuple[str, float] | None:
    """(reply list, deadline) of an entry, malformed or not, if it names a reply list of
    `prefix`, so that even a refused job's client hears why at once; never raises."""
    try:
        d = json.loads(fields.get("job", ""))
        reply_to, deadline = d["reply_to"], d.get("deadline")
        if isinstance(reply_to, str) and reply_to.startswith(f"{prefix}:replies:"):
            reply_to.encode("utf-8")
            ok = isinstance(deadline, (int, float)) and not isinstance(deadline, bool) and math.isfinite(deadline)
            return reply_to, float(deadline) if ok else time.time()
    except Exception:  # noqa: BLE001 - any content at all: no reply list then
        pass
    return None


def dead_letter_record(entry_id: str, fields: Mapping[Any, Any], reason: str, worker: str) -> str:
    """The dead-letter list's JSON line for an entry: cannot fail on the entry's content (its first
    8 fields, text as it is and anything else as repr, cut to 300 characters; JSON escapes what
    was not UTF-8)."""
    def shown(x, n):
        return (x if isinstance(x, str) else repr(x))[:n]
    shown = {shown(k, 100): shown(v, 300) for k, v in list(fields.items())[:8]}
    return json.dumps({"entry": str(entry_id), "reason": reason, "fields": shown, "worker": worker,
                       "time": time.time()})
