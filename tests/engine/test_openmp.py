"""The OpenMP wait policy `flare run` and the benchmarks set before torch loads."""

from __future__ import annotations

from flare.engine.openmp import SPIN_COUNT, set_wait_policy


def test_threads_spin_briefly_when_the_environment_chooses_nothing() -> None:
    environ: dict[str, str] = {}
    set_wait_policy(environ)
    assert environ == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_an_operators_wait_policy_is_kept() -> None:
    environ = {"OMP_WAIT_POLICY": "PASSIVE"}
    set_wait_policy(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_an_operators_spin_count_is_kept() -> None:
    environ = {"GOMP_SPINCOUNT": "50000"}
    set_wait_policy(environ)
    assert environ == {"GOMP_SPINCOUNT": "50000"}
