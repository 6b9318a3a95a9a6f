"""Resharding: a checkpoint written by 2 ranks with FSDP-sharded parameters (real torchrun
processes over gloo) loads into 1 process with the same weights and optimizer state."""

import json

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from conftest import tiny_job, torchrun
from kiln.checkpoint.checkpointer import Checkpointer
from kiln.checkpoint.storage import Storage
from kiln.config import JobConfig
from kiln.models.transformer import Transformer
from kiln.train.optim import build_optimizer

WORKER = """
import gc, json, sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from kiln.checkpoint.checkpointer import Checkpointer, Progress
from kiln.config import JobConfig
from kiln.models.transformer import Transformer
from kiln.train.optim import param_groups
from kiln.train.loss import cross_entropy_sum

dist.init_process_group("gloo")
torch.set_num_threads(1)
cfg = JobConfig.model_validate(json.loads(sys.argv[1]))
model = Transformer(cfg.model)
model.init_weights(0)
for block in model.layers.values():
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, foreach=True)  # DTensor params
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))

class Loader:  # stands in for the data loader: a position per rank
    position = dist.get_rank() * 100
    def state_dict(self): return {"position": self.position}
    def load_state_dict(self, state): self.position = state["position"]

for step in range(2):
    x = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
    cross_entropy_sum(model(x[:, :-1]), x[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
ckpt = Checkpointer(cfg, cfg.run_dir, model, optimizer, scheduler, Loader())
ckpt.save(Progress(step=2, tokens=64, elapsed=1.0))
ckpt.close()
full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if dist.get_rank() == 0:
    torch.save(full, sys.argv[2])
# Free what holds the process group (DTensors, FSDP hooks) before destroying it, not at exit.
del model, optimizer, scheduler, ckpt, full
gc.collect()
dist.destroy_process_group()
"""


class Loader:
    position = -1

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_two_rank_sharded_checkpoint_loads_into_one_rank(tmp_path):
    cfg = tiny_job(tmp_path, model={"tie_embeddings": True}, checkpoint={"keep_last": None})
    script, expected_file = tmp_path / "worker.py", tmp_path / "expected.pt"
    script.write_text(WORKER)
    torchrun([str(script), json.dumps(cfg.model_dump(mode="json", by_alias=True)), str(expected_file)])
    (committed,) = Storage(str(cfg.run_dir / "checkpoints")).committed()
    assert committed.step == 2 and committed.marker["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(committed.marker["files"])  # one shard per rank

    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    loader = Loader()
    resumed = Checkpointer(cfg, cfg.run_dir, model, optimizer, scheduler, loader).restore("auto")
    assert resumed.progress.step == 2 and resumed.progress.tokens == 64
    assert loader.position == 0 and scheduler.last_epoch == 2

    want_model, want_optim = torch.load(expected_file, weights_only=False)
    got_model, got_optim = get_state_dict(model, optimizer)
    assert got_model.keys() == want_model.keys()
    for name, tensor in want_model.items():
        assert torch.equal(got_model[name], tensor), name
    for name, state in want_optim["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got_optim["state"][name][key], state[key]), (name, key)
    assert model.lm_head.weight is model.embed.weight  # tying survives the load
