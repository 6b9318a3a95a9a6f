"""Expert parallelism on two gloo ranks: the all-to-all permutation, and a MoE layer whose
experts are split over the ranks against the whole layer."""

import json

from conftest import ROOT, torchrun


def test_tokens_reach_experts_on_other_rank_and_return_to_their_positions(tmp_path):
    result = tmp_path / "result.json"
    torchrun([str(ROOT / "tests/workers/expert_worker.py"), str(result)])
    ranks = [json.loads((tmp_path / f"result.json.rank{r}").read_text()) for r in (0, 1)]
    counts = {int(r): c for r, c in ranks[0]["counts"].items()}
    for rank, out in enumerate(ranks):
        # This rank's experts get, expert by expert, the rows every rank routed to them, each
        # the row it was (tagged by source rank and row).
        expected = []
        starts = {r: [sum(counts[r][:e]) for e in range(4)] for r in counts}
        for e in (2 * rank, 2 * rank + 1):
            for source in (0, 1):
                expected += [[source, starts[source][e] + i] for i in range(counts[source][e])]
        assert out["arrived"] == expected
        assert out["arrived_counts"] == [counts[0][e] + counts[1][e] for e in (2 * rank, 2 * rank + 1)]
        # Back through identity experts, every row is where it started.
        assert out["returned"] == out["tags"]
        # The MoE layer split over the ranks is the whole layer: outputs and gradients.
        assert out["tokens_routed_off_rank"] > 0
        assert out["y_max_diff"] < 1e-5 and out["x_grad_max_diff"] < 1e-5
        assert out["router_grad_max_diff"] < 1e-5 and out["expert_grad_max_diff"] < 1e-5
