"""sandbox/jobs.py: a stream entry is a Job or MalformedJob with a reason, whatever its content
(hypothesis), and each way of being malformed is named."""

import json
import time

import pytest
from hypothesis import given, settings, strategies as st

from sandbox.jobs import MAX_DEADLINE_S, MAX_JOB_CHARS, Job, MalformedJob, dead_letter_record, parse_job, reply_of

REPLY = "sandbox:replies:client"


def entry(**job):
    return {"job": json.dumps({"reply_to": REPLY, "deadline": time.time() + 30, **job})}


def test_well_formed_jobs_parse_to_typed_jobs():
    assert parse_job(entry(code="print(1)", timeout=2), "sandbox") == Job(
        op="run", reply_to=REPLY, deadline=pytest.approx(time.time() + 30, abs=5), code="print(1)", timeout=2)
    assert parse_job(entry(op="session_run", session="s1", code="x", stdin="in"), "sandbox").session == "s1"
    assert parse_job(entry(op="session_open"), "sandbox").op == "session_open"


# every way the issue lists, and a few more: (entry fields, words the reason must contain)
MALFORMED = [
    ({"job": "[" * 100_000}, "nests deeper"),
    ({"job": "x" * (MAX_JOB_CHARS + 1)}, "over"),
    ({"job": "{\"code\": "}, "not JSON"),
    ({"job": "null"}, "JSON object"),
    ({"job": "\udcff\udcfe"}, "not UTF-8"),                     # bytes that were not UTF-8 (surrogateescape)
    (entry(code="print(1)") | {"Job": "{}"}, "exactly one field"),  # a field named like another's
    ({"jobs": entry(code="1")["job"]}, "exactly one field"),
    (entry(code=5), "code must be text"),
    (entry(code="1", stdin=["a"]), "stdin must be text"),
    (entry(code="1", timeout="5"), "timeout must be a finite number"),
    (entry(code="1", timeout=float("nan")), "timeout must be a finite number"),
    (entry(stdin=""), "missing code"),
    (entry(code="1", evil=True), "unknown keys evil"),
    (entry(op="fork_bomb", code="1"), "unknown op"),
    (entry(op="session_run", code="1"), "missing session"),
    (entry(code="1", reply_to="other:replies:x"), "not a reply list"),
    ({"job": json.dumps({"code": "1", "reply_to": REPLY, "deadline": time.time() - 60})}, "deadline passed"),
    ({"job": json.dumps({"code": "1", "reply_to": REPLY, "deadline": time.time() + 2 * MAX_DEADLINE_S})}, "ahead"),
    ({"job": json.dumps({"code": "1", "reply_to": REPLY, "deadline": True})}, "deadline must be a finite number"),
]


@pytest.mark.parametrize("fields, words", MALFORMED)
def test_each_malformed_entry_is_refused_with_its_reason(fields, words):
    with pytest.raises(MalformedJob, match=words):
        parse_job(fields, "sandbox")
    record = json.loads(dead_letter_record("1-0", fields, "why", "w"))  # the dead-letter path never fails
    assert record["entry"] == "1-0" and record["reason"] == "why"


json_values = st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(fields=st.dictionaries(st.text(max_size=6) | st.binary(max_size=6),
                              st.text(max_size=60) | st.binary(max_size=60) | json_values.map(json.dumps),
                              max_size=3))
def test_any_entry_is_a_job_or_malformed_never_an_error(fields):
    """The worker's loop sees only Job or MalformedJob, whatever a stream entry holds."""
    try:
        assert isinstance(parse_job(fields, "sandbox"), Job)
    except MalformedJob:
        pass
    json.loads(dead_letter_record("1-0", fields, "why", "w"))
    assert reply_of(fields, "sandbox") is None or reply_of(fields, "sandbox")[0].startswith("sandbox:replies:")


def test_a_refused_job_s_client_is_still_answered_when_it_names_its_reply_list():
    assert reply_of(entry(code=5), "sandbox")[0] == REPLY
    assert reply_of({"job": "[" * 100_000}, "sandbox") is None
