"""Op-timeline reader: the real 8-rank Megatron straggler trace, tiny made-up ones, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from prism_trace.errors import MissingFieldError, TraceFormatError
from prism_trace.formats.base import FRAME_SCHEMAS, TraceTables
from prism_trace.formats.op_timeline.files import sniff_op_timeline
from prism_trace.formats.op_timeline.reader import read_op_timeline

ST = Path("megatron-straggler-st-8rank")


@pytest.fixture(scope="module")
def st_dir(shared_datasets: Path) -> Path:
    return shared_datasets / ST


@pytest.fixture(scope="module")
def st(st_dir: Path) -> TraceTables:
    return read_op_timeline(st_dir)


def _tiny(folder: Path, *, result: bool = True) -> Path:
    """A dp2 x pp2 job of steps 5 and 9: compute, p2p, dp and embedding collectives."""
    rows = []
    for step in (5, 9):
        for dp in range(2):
            for stage in range(2):
                t = 0.001 * dp
                ops = [
                    ("params-all-gather", t, 0.01, -1),
                    ("forward-compute", t + 0.02, 0.1, 0),
                    ("forward-send" if stage == 0 else "forward-recv", t + 0.12, 0.01, -1),
                    ("backward-recv" if stage == 0 else "backward-send", t + 0.3, 0.01, -1),
                    ("backward-compute", t + 0.32, 0.2, 0),
                    ("embedding-grads-all-reduce", t + 0.6, 0.05, -1),
                    ("grads-reduce-scatter", t + 0.7, 0.05, -1),
                    ("optimizer", t + 0.8, 0.05 + 0.1 * (step == 9), -1),
                ]
                rows += [
                    {
                        "dp_rank": dp,
                        "stage": stage,
                        "rank": stage * 2 + dp,
                        "step": step,
                        "optype": name,
                        "start_ts": start,
                        "duration": dur,
                        "seq_id": 0,
                        "mc": -1,
                        "mb_id": mb,
                        "gmc": -1,
                    }
                    for name, start, dur, mb in ops
                ]
    df = pl.DataFrame(rows).with_columns(
        pl.col("dp_rank", "stage", "mc", "mb_id").cast(pl.Int8),
        pl.col("rank").cast(pl.Int16),
        pl.col("optype").cast(pl.Categorical),
        pl.col("start_ts", "duration").cast(pl.Float32),
        pl.col("seq_id").cast(pl.Int32),
        pl.col("gmc").cast(pl.Int16),
    )
    folder.mkdir(parents=True, exist_ok=True)
    df.write_parquet(folder / "trace-T.parquet")
    (folder / "meta-T.yaml").write_text("dp_size: 2\npp_size: 2\ntp_size: 1\nworld_size: 4\n")
    if result:
        (folder / "result-T.json").write_text(json.dumps({"step_t_base": {"5": 1.0, "9": 1.5}}))
    return folder


# --- the real trace --------------------------------------------------------------------------


@pytest.mark.shared_data
def test_rows_per_rank_and_optype_match_the_parquet(st_dir: Path, st: TraceTables) -> None:
    raw = pl.read_parquet(st_dir / "trace-ST.parquet")
    want = raw.group_by(pl.col("rank").cast(pl.Int32), pl.col("optype").cast(pl.Utf8)).len()
    got = st.events.group_by("rank", pl.col("name").alias("optype")).len()
    assert want.sort("rank", "optype").equals(got.sort("rank", "optype"))
    assert st.events.height == 6784
    assert st.world_size == 8
    assert st.rank_ids == list(range(8))
    assert st.events.select("rank", "event_id").n_unique() == st.events.height
    for name, schema in FRAME_SCHEMAS.items():
        assert dict(getattr(st, name).schema) == schema


@pytest.mark.shared_data
def test_rank_layout_and_rank_args(st: TraceTables) -> None:
    for row in st.ranks.iter_rows(named=True):
        args = json.loads(row["args"])
        assert row["rank"] == args["stage"] * 2 + args["dp_rank"]
        assert (args["dp"], args["pp"]) == (args["dp_rank"], args["stage"])


@pytest.mark.shared_data
def test_iterations_match_step_t_base(st_dir: Path, st: TraceTables) -> None:
    base = json.loads((st_dir / "result-ST.json").read_text())["step_t_base"]
    it = st.iterations
    assert it.group_by("rank").len()["len"].to_list() == [32] * 8
    want = {int(k): round(v * 1e9) for k, v in base.items()}
    assert dict(it.filter(pl.col("rank") == 0).select("iteration", "dur").iter_rows()) == want
    # steps are laid back to back, identically on every rank
    r0 = it.filter(pl.col("rank") == 0).sort("iteration")
    assert r0["ts"][0] == 0
    assert (r0["ts"].shift(-1) - r0["ts"] - r0["dur"]).drop_nulls().to_list() == [0] * 31
    assert it.group_by("iteration").agg(pl.col("ts").n_unique())["ts"].max() == 1
    # every op lies inside its step, and each step's latest op ends exactly at step_t_base
    ev = st.events.join(it, on=["rank", "iteration"], suffix="_it")
    assert (ev["ts"] >= ev["ts_it"]).all()
    end = ev.group_by("iteration").agg(
        ((pl.col("ts") + pl.col("dur")).max() - pl.col("ts_it").first()).alias("span"),
        pl.col("dur_it").first(),
    )
    assert (end["span"] == end["dur_it"]).all()


@pytest.mark.shared_data
def test_sends_pair_with_receives(st: TraceTables) -> None:
    p2p = st.p2p
    sends = p2p.filter(pl.col("direction") == "send").select(
        src="rank", dst="peer", seq="seq", s_it="iteration", s_ts="host_ts", s_dur="host_dur"
    )
    recvs = p2p.filter(pl.col("direction") == "recv").select(
        src="peer", dst="rank", seq="seq", r_it="iteration", r_ts="host_ts", r_dur="host_dur"
    )
    assert sends.height == recvs.height == 1536
    pairs = sends.join(recvs, on=["src", "dst", "seq"], how="full", coalesce=True)
    assert pairs.height == 1536
    assert pairs.null_count().sum_horizontal().item() == 0
    assert (pairs["s_it"] == pairs["r_it"]).all()
    # the two sides of a transfer overlap in time
    assert ((pairs["r_ts"] + pairs["r_dur"]) >= pairs["s_ts"]).all()
    assert ((pairs["s_ts"] + pairs["s_dur"]) >= pairs["r_ts"]).all()
    # neighbours in the pipeline of one dp_rank only
    assert set(zip(sends["src"], sends["dst"], strict=True)) == {
        (0, 2), (2, 4), (4, 6), (1, 3), (3, 5), (5, 7),  # forward
        (2, 0), (4, 2), (6, 4), (3, 1), (5, 3), (7, 5),  # backward
    }  # fmt: skip


@pytest.mark.shared_data
def test_collectives_form_complete_instances(st: TraceTables) -> None:
    c = st.collectives.join(
        st.comm_groups.select(group_name="name", size="size", members="ranks"), on="group_name"
    )
    inst = c.group_by("group_name", "seq").agg(
        pl.col("rank").sort(),
        pl.col("members").first(),
        pl.col("kind").n_unique().alias("kinds"),
        pl.col("iteration").n_unique().alias("steps"),
    )
    assert (inst["rank"] == inst["members"]).all()
    assert set(inst["kinds"]) == {1}
    assert set(inst["steps"]) == {1}
    counts = dict(
        st.collectives.join(st.events.select("rank", "event_id", "name"), on=["rank", "event_id"])
        .group_by("name")
        .len()
        .iter_rows()
    )
    assert counts == {
        "params-all-gather": 256,
        "grads-reduce-scatter": 256,
        "embedding-grads-all-reduce": 128,
        "layernorm-grads-all-reduce": 256,
    }
    groups = {r["name"]: r for r in st.comm_groups.iter_rows(named=True)}
    assert groups["dp_stage1"]["ranks"] == [2, 3]
    assert groups["pp_dp1"]["ranks"] == [1, 3, 5, 7]
    assert groups["embd_dp0"]["ranks"] == [0, 6]
    assert groups["embd_dp1"]["description"] == "embd"
    assert groups["tp_stage2_dp1"]["ranks"] == [5]


@pytest.mark.shared_data
def test_tracks_and_categories(st: TraceTables) -> None:
    assert st.tracks.group_by("rank").len()["len"].to_list() == [3] * 8
    cats = dict(st.events.group_by("name").agg(pl.col("category").first()).iter_rows())
    assert cats["forward-compute"] == cats["optimizer"] == cats["gc"] == "compute"
    assert cats["backward-send"] == cats["params-all-gather"] == "comm"
    assert cats["optimizer-clip-main-grad"] == "comm"


@pytest.mark.shared_data
def test_sniff_and_rank_filter(st_dir: Path) -> None:
    assert sniff_op_timeline(st_dir)
    assert sniff_op_timeline(st_dir / "trace-ST.parquet")
    assert not sniff_op_timeline(st_dir / "meta-ST.yaml")
    one = read_op_timeline(st_dir / "trace-ST.parquet", rank=6)
    assert one.rank_ids == [6]
    assert set(one.events["rank"]) == {6}
    assert one.comm_groups.height == 16  # groups still list every member


# --- hand-made traces ----------------------------------------------------------------------------


def test_tiny_trace_all_frames(tmp_path: Path) -> None:
    t = read_op_timeline(_tiny(tmp_path / "run"))
    assert t.world_size == 4
    it = t.iterations.filter(pl.col("rank") == 0).sort("iteration")
    assert it.select("iteration", "ts", "dur").rows() == [(5, 0, 10**9), (9, 10**9, 15 * 10**8)]
    ev = t.events.filter((pl.col("rank") == 3) & (pl.col("iteration") == 9))
    fwd = ev.filter(pl.col("name") == "forward-compute").row(0, named=True)
    # float32 seconds in the file: exact to a few hundred ns
    assert fwd["ts"] == pytest.approx(10**9 + 21_000_000, abs=500)
    assert fwd["dur"] == pytest.approx(100_000_000, abs=500)
    assert json.loads(fwd["args"]) == {
        "step": 9, "seq_id": 0, "mc": -1, "mb_id": 0, "gmc": -1, "dp_rank": 1, "stage": 1,
    }  # fmt: skip
    p = t.p2p.filter(pl.col("rank") == 1).sort("host_ts")
    assert p.select("direction", "peer", "seq", "group_name").rows() == [
        ("send", 3, 0, "pp_dp1"),
        ("recv", 3, 0, "pp_dp1"),
        ("send", 3, 1, "pp_dp1"),
        ("recv", 3, 1, "pp_dp1"),
    ]
    c = t.collectives.filter(pl.col("rank") == 2).sort("host_ts")
    assert c.select("group_name", "seq", "kind").rows() == [
        ("dp_stage1", 0, "all_gather"),
        ("embd_dp0", 0, "all_reduce"),
        ("dp_stage1", 1, "reduce_scatter"),
        ("dp_stage1", 2, "all_gather"),
        ("embd_dp0", 1, "all_reduce"),
        ("dp_stage1", 3, "reduce_scatter"),
    ]
    assert set(t.comm_groups["name"]) == {
        "dp_stage0", "dp_stage1", "pp_dp0", "pp_dp1", "embd_dp0", "embd_dp1",
    }  # fmt: skip


def test_without_result_json_steps_span_their_ops(tmp_path: Path) -> None:
    t = read_op_timeline(_tiny(tmp_path / "run", result=False) / "trace-T.parquet")
    it = t.iterations.filter(pl.col("rank") == 0).sort("iteration")
    # step 5 ends with dp_rank 1's optimizer at 0.001 + 0.8 + 0.05 s
    assert it["dur"].to_list() == pytest.approx([851_000_000, 951_000_000], abs=500)
    assert it["ts"][1] == it["dur"][0]


def test_unknown_rank_filter(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="rank 9 is not in the op timeline"):
        read_op_timeline(_tiny(tmp_path / "run"), rank=9)


# --- broken inputs ------------------------------------------------------------------------------


def test_missing_column(tmp_path: Path) -> None:
    folder = _tiny(tmp_path / "run")
    bad = tmp_path / "trace-bad.parquet"
    pl.read_parquet(folder / "trace-T.parquet").drop("optype").write_parquet(bad)
    with pytest.raises(
        MissingFieldError, match=r"trace-bad\.parquet: missing required column `optype`"
    ):
        read_op_timeline(bad)
    assert not sniff_op_timeline(bad)


@pytest.mark.parametrize("cut", [0.5, 0.95])
def test_truncated_parquet(tmp_path: Path, cut: float) -> None:
    raw = (_tiny(tmp_path / "run") / "trace-T.parquet").read_bytes()
    bad = tmp_path / "trace-cut.parquet"
    bad.write_bytes(raw[: int(len(raw) * cut)])
    with pytest.raises(TraceFormatError, match=r"trace-cut\.parquet") as exc:
        read_op_timeline(bad)
    assert "\n" not in str(exc.value)


def test_garbage_parquet(tmp_path: Path) -> None:
    bad = tmp_path / "trace-x.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file" * 10)
    with pytest.raises(TraceFormatError, match=r"trace-x\.parquet"):
        read_op_timeline(bad)
    assert not sniff_op_timeline(bad)


def test_inconsistent_rank_layout(tmp_path: Path) -> None:
    folder = _tiny(tmp_path / "run")
    df = pl.read_parquet(folder / "trace-T.parquet")
    df = df.with_columns(
        pl.when(pl.col("rank") == 3).then(pl.lit(2, pl.Int16)).otherwise("rank").alias("rank")
    )
    df.write_parquet(folder / "trace-T.parquet")
    with pytest.raises(TraceFormatError, match="not one-to-one"):
        read_op_timeline(folder)


def test_send_from_last_stage_has_no_peer(tmp_path: Path) -> None:
    folder = _tiny(tmp_path / "run")
    df = pl.read_parquet(folder / "trace-T.parquet").with_columns(pl.col("optype").cast(pl.Utf8))
    df = df.with_columns(
        pl.when(pl.col("optype") == "forward-recv")
        .then(pl.lit("forward-send"))
        .otherwise("optype")
        .alias("optype")
    )
    df.write_parquet(folder / "trace-T.parquet")
    with pytest.raises(TraceFormatError, match=r"`forward-send` on rank 2 .* has no peer stage"):
        read_op_timeline(folder)


def test_folder_without_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"expected one `trace-<trial>\.parquet`"):
        read_op_timeline(tmp_path)
    assert not sniff_op_timeline(tmp_path)
