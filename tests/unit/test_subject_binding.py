"""A message names who sent it (a job, a store), and so does the subject it came on, which the server
lets only that job's or that store's key publish on: the services take a message only where the two
agree. Without it, job A's key spoke for job B on A's own subjects, and a store for another store."""

from __future__ import annotations

import time

import pytest

from deadpool_protocol import (
    MemberError,
    MemberErrorCause,
    MemberHello,
    ProtocolError,
    Replicate,
    SnapshotComplete,
    StoreAddress,
    StoreStatus,
    Subjects,
    decode_on,
    encode,
    subject_refusal,
)
from deadpool_protocol.subjects import service_inbox, store_announce, store_replicate

A, B = Subjects.for_job("job-a"), Subjects.for_job("job-b")


def test_a_jobs_message_is_taken_on_that_jobs_subjects_only() -> None:
    hello = MemberHello("job-b", 0, "m-0", "h", 1, "", 0, 2, "127.0.0.1", 29500, time.time())
    error = MemberError("job-b", 1, "m-0", 0, "forged", time.time(), MemberErrorCause.USER_CODE)
    assert subject_refusal(B.hello, hello) == "" and subject_refusal(B.member_error, error) == ""
    for subject, message in ((A.hello, hello), (A.member_error, error)):
        assert "another job's subject" in subject_refusal(subject, message)
    with pytest.raises(ProtocolError, match="another job's subject"):
        decode_on(A.hello, encode(hello), MemberHello)
    assert decode_on(B.hello, encode(hello), MemberHello) == hello


def test_a_stores_announcement_and_reports_are_taken_on_its_own_subjects_only() -> None:
    status = StoreStatus("store-1", "127.0.0.1", 7001, 0, 100, 0, time.time())
    assert subject_refusal(store_announce("store-1"), status) == ""
    assert "another store's subject" in subject_refusal(store_announce("store-0"), status)
    report = SnapshotComplete("job-a", 1, "store-1", 5, [0], [10])
    assert subject_refusal(A.snapshot_complete_by("store-1"), report) == ""
    assert "another store's subject" in subject_refusal(A.snapshot_complete_by("store-0"), report)
    assert "another job's subject" in subject_refusal(B.snapshot_complete_by("store-1"), report)


def test_replies_and_service_inboxes_are_not_job_subjects() -> None:
    error = MemberError("job-b", 1, "m-0", 0, "x", time.time())
    assert subject_refusal(f"{service_inbox('detector')}.abc", error) == ""
    assert service_inbox("store", "store-0") == "_INBOX.deadpool-store.store-0"


def test_a_services_subject_may_carry_any_jobs_message_and_no_job_takes_a_services_name() -> None:
    """The swapper asks a store to replicate job J's copy on the store's own subject."""
    replicate = Replicate("job-a", 1, 0, 3, "s0", StoreAddress("s1", "127.0.0.1", 7002))
    assert subject_refusal(store_replicate("s0"), replicate) == ""
    for name in ("store", "swapper"):
        with pytest.raises(ValueError, match="kept for the services"):
            Subjects.for_job(name)
