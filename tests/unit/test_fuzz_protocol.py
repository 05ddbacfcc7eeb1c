"""Property-based fuzzing of everything a peer can send: control messages, data-plane frame headers,
and the store's upload protocol as a state machine. Nothing but the protocol's own errors may come
out, and nothing that must be refused may be accepted (`fuzz_properties`). The CI profile runs a few
thousand cases; `bench/fuzz.py` runs a hundred thousand and more."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.fuzz_properties import (
    StoreProtocol,
    check_forged_publication,
    check_forged_read,
    check_frame_bytes,
    check_message_bytes,
    check_oversized_message,
    check_token_frame,
    forged_publications,
    forged_reads,
    frame_bodies,
    message_bodies,
    oversized_messages,
    token_frames,
)

CI = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@CI
@given(st.binary(max_size=256))
def test_random_bytes_are_refused_as_a_message_or_decode_to_a_sound_one(data: bytes) -> None:
    check_message_bytes(data)


@CI
@given(message_bodies())
def test_maps_shaped_like_messages_are_refused_or_decode_to_sound_ones(data: bytes) -> None:
    check_message_bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(oversized_messages())
def test_a_message_with_any_value_over_its_bound_is_refused_naming_the_field_and_the_bound(
    case: tuple[bytes, str, str],
) -> None:
    check_oversized_message(*case)


@CI
@given(st.binary(max_size=256))
def test_random_bytes_are_refused_as_a_frame_header_or_decode_to_a_bounded_one(data: bytes) -> None:
    check_frame_bytes(data)


@CI
@given(frame_bodies())
def test_maps_shaped_like_frames_are_refused_or_decode_to_bounded_ones(data: bytes) -> None:
    check_frame_bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_frames())
def test_a_keyed_store_lets_through_only_frames_with_their_jobs_own_token(data: bytes) -> None:
    check_token_frame(data)


TestStoreProtocol = StoreProtocol.TestCase
TestStoreProtocol.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@CI
@given(forged_publications())
def test_no_key_gets_a_well_formed_forgery_taken(case: tuple[str, str, bytes]) -> None:
    """A job's key and a store's key, sending any kind of message, naming their own job or store or a
    victim's, on any subject DeadPool listens on: the server or the services refuse every one that is
    not the key's own to say."""
    check_forged_publication(case)


@CI
@given(forged_reads())
def test_no_key_reads_another_jobs_replies_or_another_stores_requests(case: tuple[str, str]) -> None:
    check_forged_read(case)
