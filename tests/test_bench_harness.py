"""benchmarks/harness.py, what every benchmark shares: the gloo world, alternating rounds, the
statistics, JSON out and the one-line command-line errors."""

import json

import pytest
import torch
import torch.distributed as dist

from benchmarks import harness


def test_alternate_rotates_the_order_each_round():
    seen = []
    variants = {name: (lambda n=name: seen.append(n) or len(seen)) for name in "abc"}
    out = harness.alternate(variants, rounds=4)
    assert seen == list("abcbcacababc")
    assert out == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}
    seen.clear()
    harness.alternate(variants, rounds=2, rotate=False)
    assert seen == list("abcabc")


def test_spread_and_json(tmp_path):
    assert harness.spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    path = tmp_path / "sub" / "out.json"
    harness.write_json(path, {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]  # no temporary left


def test_cli_errors_are_one_line(capsys):
    def main(argv):
        parser = harness.Parser(prog="x")
        parser.add_argument("--n", type=int, required=True)
        parser.parse_args(argv)
        return 0

    assert harness.run_cli(main, ["--n", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --n: invalid int value") and err.count("\n") == 1
    assert harness.run_cli(main, ["--n", "3"]) == 0


def _rank_and_sum(scale: int) -> tuple[int, int, float, int]:
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), scale * x.item(), torch.get_num_threads()


@pytest.mark.spawn
def test_spawn_runs_a_gloo_world_and_returns_each_ranks_result():
    assert harness.spawn(2, _rank_and_sum, 10) == [(0, 2, 30.0, 1), (1, 2, 30.0, 1)]
