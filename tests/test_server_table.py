"""Per-client server tables (``fedskew.algorithms.server_table``, ``fedskew.engine.table_store``): a new
table shares its untouched rows with the old one, which stays unchanged; a handed table cannot be written
(structurally: an error; in place: the contract suite's fingerprint sees it); rows spilled beyond the budget
read back bit for bit and checkpoint exactly (a FedFomo run that spills, interrupted and resumed, equals one
that does neither, embedded, on engine workers and on Flower); a crafted checkpoint's file names are refused,
never used as paths."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from fedskew.algorithms.base import ContractError, Payload, RoundInfo, ServerTable, Upload, model_arrays
from fedskew.algorithms.fedfomo import IDS, WEIGHTS, FedFomo
from fedskew.algorithms.server_table import Row
from fedskew.engine.states import STATES_DIR, SpillingStates
from fedskew.engine.table_store import TABLE_TAG, TableStore, table_tag
from fedskew.errors import FedskewError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import CHECKPOINT_FILE, DIGEST_KEY, run_experiment, tree_digest
from fedskew.testing import fingerprint
from tests.conftest import TinyLinearModel, tiny_context
from tests.test_contract import tiny_config

ROW_BYTES = 1024 * 4  # one row: 1024 float32


def _rows(cids: list[int], seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Rows of 4 KB with NaN, inf and -0.0 in them (bit-for-bit checks) and a small integer entry."""
    out = {}
    for cid in cids:
        w = torch.randn(1024, generator=torch.Generator().manual_seed(seed * 100 + cid))
        w[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
        out[cid] = {"w": w, "n": torch.tensor([cid])}
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _same_row(a, b) -> bool:  # type: ignore[no-untyped-def]
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and _bits(a[k]) == _bits(b[k]) for k in a)


# ---------------------------------------------------------------------------- copy-on-write
def test_a_new_table_shares_untouched_rows_and_the_old_one_is_unchanged():
    rows = _rows([3, 0, 1, 2])
    old = ServerTable(rows)
    new = old.with_rows({2: {"w": torch.zeros(4)}, 7: {"w": torch.ones(4)}})
    assert list(old) == [0, 1, 2, 3] and list(new) == [0, 1, 2, 3, 7]  # ascending, whatever the order given
    assert new.ids().tolist() == [0, 1, 2, 3, 7] and new.ids().dtype == torch.long and 7 not in old
    for cid in (0, 1, 3):  # shared, not copied: the very row and tensor objects
        assert new[cid] is old[cid] and new[cid]["w"] is old[cid]["w"]
    assert old[2]["w"] is rows[2]["w"] and _same_row(old[2], rows[2])  # the handed table is as it was
    assert torch.equal(new[2]["w"], torch.zeros(4)) and "n" not in new[2]
    assert old.get(9) is None and len(ServerTable()) == 0


def test_fedfomo_aggregate_copies_only_the_uploaders_rows():
    ctx = tiny_context()
    alg = FedFomo(FedFomo.Params(), ctx)

    def upload(cid: int, bias: float) -> Upload:
        up = Payload(
            arrays=model_arrays({k: torch.full_like(v, bias) for k, v in ctx.initial_state(0).items()})
        )
        up.arrays.update({IDS: torch.tensor([1 - cid]), WEIGHTS: torch.tensor([0.5])})
        return Upload(cid, 3, up)

    first = alg.aggregate(
        alg.init_server(TinyLinearModel()), [upload(0, 1.0), upload(1, 2.0)], RoundInfo(1, None, 0)
    )
    server = first.state
    second = alg.aggregate(server, [upload(1, 5.0)], RoundInfo(2, None, 0)).state
    assert second["models"][0] is server["models"][0] and second["P"][0] is server["P"][0]  # not copied
    assert float(second["models"][1]["classifier.bias"][0]) == 5.0
    assert float(server["models"][1]["classifier.bias"][0]) == 2.0  # the handed table is unchanged
    assert second["P"][1]["P"].tolist() == [1.0, 0.0] and server["P"][1]["P"].tolist() == [0.5, 0.0]


# -------------------------------------------------------------------------- a hook cannot write into a table
def test_writing_into_a_table_or_a_row_is_refused():
    table = ServerTable(_rows([0, 1]))
    with pytest.raises(ContractError, match=r"read-only.*with_rows"):
        table[0] = {"w": torch.zeros(1)}
    with pytest.raises(ContractError, match="read-only"):
        del table[1]
    with pytest.raises(ContractError, match="read-only"):
        table[0]["w"] = torch.zeros(1)
    with pytest.raises(ContractError, match="read-only"):
        del table[0]["n"]
    assert _same_row(table[0], _rows([0])[0]) and list(table) == [0, 1]


@pytest.mark.parametrize("cid", ["../x", -1, True, 1.0])
def test_a_row_key_that_is_not_a_client_id_is_refused(cid):
    with pytest.raises(ContractError, match="client ids"):
        ServerTable().with_rows({cid: {"w": torch.zeros(1)}})


def test_a_hook_changing_a_row_tensor_in_place_is_seen_by_the_contract_fingerprint():
    """What tests/test_contract.py checks for every method: the handed server state's fingerprint, which
    reads a table's rows; a well-behaved aggregate leaves it, one that adds into a shared row does not."""
    ctx = tiny_context()

    class Sneaky(FedFomo):
        def aggregate(self, server, uploads, info):  # type: ignore[no-untyped-def]
            server["P"][0]["P"].add_(1.0)  # a write into the handed table's row
            return super().aggregate(server, uploads, info)

    up = Payload(arrays=model_arrays(ctx.initial_state(0)))
    up.arrays.update({IDS: torch.tensor([1]), WEIGHTS: torch.tensor([0.5])})
    server = (
        FedFomo(FedFomo.Params(), ctx)
        .aggregate(
            FedFomo(FedFomo.Params(), ctx).init_server(TinyLinearModel()),
            [Upload(0, 3, up)],
            RoundInfo(1, None, 0),
        )
        .state
    )
    before = fingerprint(server)
    FedFomo(FedFomo.Params(), ctx).aggregate(server, [Upload(1, 3, up)], RoundInfo(2, None, 0))
    assert fingerprint(server) == before
    Sneaky(FedFomo.Params(), ctx).aggregate(server, [Upload(1, 3, up)], RoundInfo(2, None, 0))
    assert fingerprint(server) != before


# ---------------------------------------------------------------------------- spilling and checkpoints
def test_rows_beyond_the_budget_spill_and_read_back_bit_for_bit(tmp_path):
    rows = _rows(list(range(8)))
    store = TableStore(3 * ROW_BYTES + 100, tmp_path)
    handed = {"t": ServerTable(rows), "weights": {"x": torch.ones(2)}}
    server = store.commit(1, handed)
    assert len(list(tmp_path.glob("t*-r1-c*.pt"))) == 5  # the 5 oldest (then lowest ids) went to disk
    assert all(isinstance(c, Row) for c in handed["t"].cells().values())  # the handed table: as it was
    assert all(_same_row(server["t"][c], rows[c]) for c in rows)  # read back exactly
    # a checkpoint is plain data that weights_only loads, and restores the same rows
    buf = io.BytesIO()
    torch.save(store.state_dict(server), buf)
    plain = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert plain["t"][TABLE_TAG] == 1 and len(plain["t"]["spilled"]) == 5 and len(plain["t"]["rows"]) == 3
    restored = TableStore(3 * ROW_BYTES + 100, tmp_path).load_state_dict(plain)
    assert list(restored["t"]) == list(range(8)) and all(_same_row(restored["t"][c], rows[c]) for c in rows)
    assert torch.equal(restored["weights"]["x"], torch.ones(2))


def test_a_replaced_spilled_row_is_deleted_once_no_checkpoint_names_it(tmp_path):
    store = TableStore(ROW_BYTES + 100, tmp_path)
    server = store.commit(1, {"t": ServerTable(_rows([0, 1]))})
    assert [p.name for p in tmp_path.glob("*.pt")] == [f"t{_tag()}-r1-c0.pt"]
    store.state_dict(server)  # a checkpoint names r1-c0
    server = store.commit(2, {"t": server["t"].with_rows(_rows([0], seed=1))})
    assert (tmp_path / f"t{_tag()}-r1-c0.pt").exists()  # still named by the last checkpoint
    store.state_dict(server)
    store.state_dict(server)  # two later checkpoints: nothing names it any more
    assert not (tmp_path / f"t{_tag()}-r1-c0.pt").exists()
    assert _same_row(server["t"][0], _rows([0], seed=1)[0]) and _same_row(server["t"][1], _rows([1])[1])


def _tag() -> str:
    return table_tag("t")


def _fomo(rounds: int, budget_mb: float, **engine) -> dict:  # type: ignore[no-untyped-def]
    return tiny_config("fedfomo", rounds=rounds, state_memory_mb=budget_mb, **engine)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """FedFomo, 3 rounds, everything in memory."""
    out = tmp_path_factory.mktemp("fomo") / "run"
    run_experiment(build_config(_fomo(3, 1024)), out)
    assert not list((out / STATES_DIR).glob("t*.pt"))
    return _metrics(out)


TINY = 0.02  # MB: about one client model (~12 KB) in memory, the other rows on disk


class _Stop(Exception):
    pass


def test_fedfomo_resumed_with_spilled_rows_equals_the_uninterrupted_run(tmp_path, uninterrupted):
    out = tmp_path / "run"

    def stop(sim, record):  # type: ignore[no-untyped-def]
        if sim.round == 2:
            raise _Stop

    with pytest.raises(_Stop):
        run_experiment(build_config(_fomo(3, TINY)), out, on_round=stop)
    ckpt = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    assert ckpt["round"] == 2 and ckpt["server"]["models"][TABLE_TAG] == 1
    assert ckpt["server"]["models"]["spilled"]  # rows really went to disk, in the output folder
    assert list((out / STATES_DIR).glob("t*.pt"))
    run_experiment(build_config(_fomo(3, TINY)), out, resume=True)
    assert _metrics(out) == uninterrupted


def test_fedfomo_with_spilled_rows_on_engine_workers_gives_the_same_numbers(tmp_path, uninterrupted):
    """The workers get the server state each round: spilled rows travel as file references."""
    run_experiment(build_config(_fomo(3, TINY, workers=2)), tmp_path / "run")
    assert _metrics(tmp_path / "run") == uninterrupted


def test_fedfomo_with_spilled_rows_on_flower_gives_the_embedded_numbers(tmp_path, uninterrupted):
    pytest.importorskip("flwr")
    from tests.flower_loopback import LoopbackGrid
    from tests.test_flower import assert_same_metrics, on_flower

    raw = _fomo(3, TINY)
    raw["engine"]["nodes"] = 3
    there = on_flower(raw, tmp_path / "flower", LoopbackGrid(3))
    assert list((tmp_path / "flower" / STATES_DIR).glob("t*.pt"))  # the ServerApp spilled its table
    assert_same_metrics(
        uninterrupted, [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in there]
    )


# ---------------------------------------------------------------------------- crafted checkpoints
BAD_NAMES = [
    "../victim.pt",
    "../../etc/passwd",
    "/tmp/victim.pt",
    "sub/t00000000-r1-c1.pt",
    "..",
    "t0-r1-c1.pt",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_crafted_row_file_name_is_refused_with_one_line(tmp_path, name):
    plain = {"t": {TABLE_TAG: 1, "rows": {}, "spilled": {0: [name, 10]}, "rounds": {}}}
    with pytest.raises(FedskewError, match="refusing") as err:
        TableStore(None, tmp_path / "states").load_state_dict(plain)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["../victim.pt", "/tmp/r1-c1.pt", "x/r1-c1.pt"])
def test_a_crafted_client_state_file_name_is_refused_with_one_line(tmp_path, name):
    store = SpillingStates(lambda cid: {}, 1 << 20, tmp_path / "states")
    sd = {"format": 2, "memory": {}, "rounds": {}, "spilled": {0: [name, 10]}}
    with pytest.raises(FedskewError, match="refusing") as err:
        store.load_state_dict(sd)
    assert "\n" not in str(err.value)


def test_resuming_from_a_checkpoint_with_a_crafted_row_name_touches_no_file(tmp_path):
    """The whole path: a checkpoint whose digest was recomputed (an attacker can) naming a file outside the
    run; the resume stops with one line and the file is neither read nor deleted."""
    out = tmp_path / "run"
    run_experiment(build_config(_fomo(2, TINY)), out)
    victim = tmp_path / "victim.pt"
    torch.save({"w": torch.zeros(1)}, victim)
    sd = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    spilled = sd["server"]["models"]["spilled"]
    cid = next(iter(spilled))
    spilled[cid] = ["../../victim.pt", victim.stat().st_size]
    sd[DIGEST_KEY] = tree_digest(sd)
    torch.save(sd, out / CHECKPOINT_FILE)
    with pytest.raises(FedskewError, match="refusing") as err:
        run_experiment(build_config(_fomo(3, TINY)), out, resume=True)
    assert "\n" not in str(err.value) and victim.is_file()


def test_a_checkpoint_of_the_former_fedfomo_layout_is_refused_before_a_round():
    """FedFomo kept ``models``/``P`` as stacked tensors before the table; such a checkpoint's server state has
    other keys, and resuming it would fail mid-round: it is refused with one line at load."""
    from fedskew.experiment.runner import build_simulation

    sim = build_simulation(build_config(tiny_config("fedfomo")))
    try:
        sd = sim.state_dict()
        assert set(sd["server"]) == {"models", "P"}  # the same names the former layout had, as tensors
        sd["server"] = {"models": torch.zeros(4, 3), "P": torch.eye(4)}
        with pytest.raises(FedskewError, match="checkpoint's server state is .*'models': 'Tensor'") as err:
            sim.load_state_dict(sd)
        assert "\n" not in str(err.value) and sim.round == 0
    finally:
        sim.close()
