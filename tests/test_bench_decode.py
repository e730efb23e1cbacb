"""benchmarks/decode.py at toy sizes: the same output as the dense twin, a cache shard of S / N per
device, and the same two collectives per token at every length (counted in the compiled program)."""
import jax
import numpy as np

from benchmarks import decode, report


def test_decode_mode_rows_show_constant_collectives_and_sharded_memory():
    args = decode.parse_args(["--lengths", "64,128", "--repeats", "2", "--heads", "4", "--kv-heads", "2",
                              "--dim", "8"])
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = [row for s in (64, 128) for row in decode.measure(args, s, mesh)]
    by = {(r["impl"], r["seq"]): r for r in rows}
    for s in (64, 128):
        sharded, dense = by["sharded", s], by["dense", s]
        assert sharded["collectives"] == {"all-reduce": 2} and dense["collectives"] == {}
        assert sharded["cache_bytes_per_device"] * 8 == dense["cache_bytes_per_device"] == 2 * s * 2 * 8 * 4
        assert sharded["latency_s"] > 0 and np.isclose(sharded["tokens_per_s"], 1 / sharded["latency_s"])
    table = decode.table(rows)
    assert "| 64K |" not in table and "| 64 | sharded | 8 |" in table and "| 128 | dense | 1 |" in table
    assert "2 all-reduce" in table and "| vs fastest |" in table
    for s in (64, 128):  # each latency over the faster one's at that length, from the same run
        fastest = min(by["sharded", s]["latency_s"], by["dense", s]["latency_s"])
        for name in ("sharded", "dense"):
            line = next(line for line in table.splitlines() if line.startswith(f"| {s} | {name} |"))
            assert line.split(" | ")[4] == report.ratio(by[name, s]["latency_s"], fastest)


def test_dense_twin_matches_the_sharded_step():
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    args = decode.parse_args(["--repeats", "1", "--heads", "4", "--kv-heads", "2", "--dim", "8"])
    impls = decode.setup(args, 64, mesh)
    (sharded, tok, cache, _), (dense, dense_tok, dense_cache, _) = impls["sharded"], impls["dense"]
    o_sharded, _ = sharded(*tok, cache)
    o_dense, _ = dense(*dense_tok, dense_cache)
    assert np.abs(np.asarray(o_sharded) - np.asarray(o_dense)).max() < 1e-5
