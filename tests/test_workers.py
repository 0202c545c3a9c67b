"""How the suite is shared among xdist workers (tests/support/workers.py): the units decide
which tests may run beside which."""

from __future__ import annotations

from tests.support.workers import work_unit


def test_the_vllm_engine_tests_are_one_unit_and_sglang_is_its_own() -> None:
    vllm = work_unit("tests/engines/test_vllm_real.py::test_lru_pressure_evicts_tails_first")
    oracle = work_unit("tests/engines/test_oracle.py::test_x")
    sglang = work_unit("tests/engines/test_sglang_real.py::test_store[page1-llama3]")
    assert vllm == oracle == "tests/engines/"
    assert sglang == work_unit("tests/engines/test_sglang_real.py::test_clear[page16-chatml]")
    assert sglang != vllm


def test_shared_set_up_modules_are_whole_and_other_tests_alone() -> None:
    a = work_unit("tests/reliability/test_many_routers.py::test_a")
    b = work_unit("tests/reliability/test_many_routers.py::test_b")
    assert a == b == "tests/reliability/test_many_routers.py"
    assert work_unit("tests/test_index.py::test_x[redis-cluster]") == "tests/test_index.py"
    one = "tests/test_zmq_source.py::test_engine_restart_clears_then_applies_the_new_batch"
    assert work_unit(one) == one
