"""Config files: valid ones resolve, bad ones give one clear paragraph (no traceback)."""

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.errors import KilnError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_quickstart_resolves_with_overrides():
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      ["optim.lr=1e-3", "train.max_steps=200", "name=007", "train.max_time=null",
                       "metrics.progress_bar=off"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 200
    assert cfg.name == "007"
    assert cfg.train.max_time is None
    assert cfg.metrics.progress_bar == "off"
    assert cfg.model.dim == 384  # from the preset


def test_preset_fields_can_be_overridden(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  preset: qwen3-0.6b\n  n_layers: 2\n"))
    assert (cfg.model.n_layers, cfg.model.head_dim, cfg.model.qk_norm) == (2, 128, True)


@pytest.mark.parametrize("text, expected", [
    ("model:\n  dimm: 64\n", ["unknown key 'model.dimm'", "allowed here:", "dim,"]),
    ("train:\n  max_steps: lots\n", ["'train.max_steps'", "valid integer", "'lots'"]),
    ("model:\n  dim: 100\n  n_heads: 3\n", ["'model'", "n_heads=3 must divide dim=100"]),
    ("model:\n  n_heads: 8\n  n_kv_heads: 3\n", ["n_kv_heads=3 must divide n_heads=8"]),
    ("model:\n  preset: gpt-5\n", ["unknown preset 'gpt-5'", "llama-3.2-1b"]),
    ("precision:\n  dtype: fp4\n", ["'precision.dtype'", "'fp16' or 'fp8'"]),
    ("train:\n  max_steps: null\n", ["set at least one of max_steps, max_tokens, max_time"]),
    ("model:\n  dim: [1, 2\n", ["is not valid YAML", "at line 3"]),
    ("- just\n- a list\n", ["must hold a mapping of sections"]),
    ("data:\n  seq_len: 4096\nmodel:\n  max_seq_len: 1024\n", ["data.seq_len=4096 exceeds"]),
])
def test_bad_config_names_key_and_file(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(KilnError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    for fragment in expected:
        assert fragment in message, message
    assert "\n" not in message


def test_bad_override_is_named(tmp_path):
    path = write(tmp_path, "name: x\n")
    with pytest.raises(KilnError, match=r"unknown key 'optim.learning_rate' \(from --set\)"):
        load_config(path, ["optim.learning_rate=1"])
    with pytest.raises(KilnError, match="expected KEY=VALUE"):
        load_config(path, ["optim.lr"])


def test_cli_prints_error_without_traceback(tmp_path):
    path = write(tmp_path, "model:\n  n_heads: 8\n  n_kv_heads: 3\n")
    for args in (["config", "show", str(path)], ["train", str(path)],
                 ["train", str(tmp_path / "missing.yaml")]):
        proc = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True)
        assert proc.returncode == 2
        assert proc.stderr.startswith("kiln: error: ")
        assert "Traceback" not in proc.stderr
