"""A request's states in the engine (RequestState) and the events that move it, checked
against the transition table, without a backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from butter.engine.admission import Ticket
from butter.engine.generation import (
    HAS_STEP_WORK,
    TRANSITIONS,
    Generation,
    IllegalTransition,
    RequestState,
)
from butter.sampling import SamplingParams

S = RequestState


def _generation() -> Generation:
    return Generation(prompt=(1, 2, 3), params=SamplingParams(), max_tokens=4,
                      ticket=Ticket(number=0, cells=7))


# Each event, as the engine (or the request's own code) sends it.
EVENTS: dict[str, Callable[[Generation], None]] = {
    "leased": lambda g: g._leased(restoring=False),
    "leased for a restore": lambda g: g._leased(restoring=True),
    "restore done": lambda g: g._restore_done(),
    "sampled": lambda g: g._sampled(),
    "client left": lambda g: g.close(),
    "stop string": lambda g: g.close("stop"),
    "finished": lambda g: g._finish("length"),
}

# The paths from QUEUED to each state, by events.
PATHS: dict[RequestState, tuple[str, ...]] = {
    S.QUEUED: (),
    S.RESTORING: ("leased for a restore",),
    S.PREFILLING: ("leased",),
    S.DECODING: ("leased", "sampled"),
    S.CANCELLED: ("leased", "client left"),
    S.FINISHED: ("leased", "sampled", "finished"),
}


def _in(state: RequestState) -> Generation:
    generation = _generation()
    for event in PATHS[state]:
        EVENTS[event](generation)
    assert generation.state is state
    return generation


def test_every_state_is_reachable_and_ends_finished() -> None:
    reachable, frontier = {S.QUEUED}, [S.QUEUED]
    while frontier:
        for after in TRANSITIONS[frontier.pop()] - reachable:
            reachable.add(after)
            frontier.append(after)
    assert reachable == set(RequestState)
    assert TRANSITIONS[S.FINISHED] == frozenset()
    assert all(S.FINISHED in TRANSITIONS[state] for state in RequestState
               if state is not S.FINISHED)
    assert HAS_STEP_WORK == {S.PREFILLING, S.DECODING}


@pytest.mark.parametrize("state", list(RequestState))
@pytest.mark.parametrize("event", list(EVENTS))
def test_every_event_in_every_state_follows_the_table(state: RequestState, event: str) -> None:
    """An event either moves the request along an edge of TRANSITIONS, leaves it where it
    is, or is refused as a bug (never a silent jump)."""
    generation = _in(state)
    try:
        EVENTS[event](generation)
    except IllegalTransition:
        assert event in ("leased", "leased for a restore")  # only a lease can be a bug
        assert generation.state is state
        return
    assert generation.state is state or generation.state in TRANSITIONS[state]


def test_a_finished_request_stays_finished_with_its_first_reason() -> None:
    generation = _in(S.DECODING)
    generation.close("stop")
    generation.close()  # the route's `finally`
    generation._finish("aborted", "the model was unloaded")
    assert (generation.state, generation.finish_reason, generation.error) == (
        S.FINISHED, "stop", None)


def test_a_request_cancelled_during_its_restore_is_not_revived() -> None:
    generation = _in(S.RESTORING)
    assert not generation.attached.is_set()  # its cached tokens are not known yet
    generation.close()
    generation._restore_done()
    assert generation.state is S.CANCELLED and generation.attached.is_set()


def test_only_the_first_sample_marks_the_prompt_evaluated() -> None:
    generation = _in(S.PREFILLING)
    assert generation.attached.is_set() and not generation.prompt_evaluated
    generation._sampled()
    first = generation.first_token_at
    generation._sampled()
    assert generation.prompt_evaluated and generation.first_token_at == first
    assert generation.state is S.DECODING
