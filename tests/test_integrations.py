"""The trainer callbacks with the real libraries: same parameters as without tierstore."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tierstore

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

STEPS = 3


def _disk_settings(spill: Path) -> dict[str, Any]:
    return {
        "device_budget": 0,
        "host_budget": 0,
        "disk_budget": "256MiB",
        "disk_path": spill,
        "min_offload_bytes": 0,
    }


@pytest.fixture
def spill(tmp_path: Path) -> Path:
    path = tmp_path / "spill"
    path.mkdir()
    return path


def _assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, value in pa.items():
        assert torch.equal(value, pb[name]), f"{name} differs"


# -- Hugging Face Trainer -------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 8, seq: int = 32) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 128, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_train(
    out: Path, callbacks: list[Any], gradient_checkpointing: bool = False
) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=128,
            max_position_embeddings=64,
        )
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        logging_steps=1,
        disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)
    trainer.train()
    return model, trainer


# transformers 5 renames gradient_checkpointing to activation_checkpointing; 4.x has
# only the former.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_hf_trainer_callback_matches_plain_training(
    tmp_path: Path, spill: Path, gradient_checkpointing: bool
) -> None:
    from tierstore.integrations.transformers import TierstoreCallback

    expected, _ = _hf_train(tmp_path / "plain", [], gradient_checkpointing)
    callback = TierstoreCallback(**_disk_settings(spill))
    got, trainer = _hf_train(tmp_path / "offload", [callback], gradient_checkpointing)

    _assert_same_parameters(expected, got)
    assert callback.store is not None and callback.store.closed
    stats = callback.stats()
    assert stats.tiers["disk"].peak_bytes > 0
    assert stats.tiers["disk"].entries == 0
    assert list(spill.iterdir()) == []
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == STEPS
    assert all(entry["tierstore/disk_peak_bytes"] > 0 for entry in logged)
    assert "tierstore/unpack_wait_s" in logged[-1]
    # The hooks are gone with the store: evaluation after training still runs.
    got(torch.zeros(1, 4, dtype=torch.long))


def test_hf_callback_rejects_a_bad_setting() -> None:
    from tierstore.integrations.transformers import TierstoreCallback

    with pytest.raises(tierstore.ConfigError, match="disk_budget"):
        TierstoreCallback(disk_budget="lots")


# -- Lightning ------------------------------------------------------------------------


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    """Trainer(deterministic=True) switches torch's global setting on; put it back."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _lightning_train(root: Path, callbacks: list[Any], package: str = "lightning") -> nn.Module:
    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else package)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 1))

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(0, verbose=False)
    module = Tiny()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1))
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=str(root),
        callbacks=callbacks,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    module.trainer_metrics = dict(trainer.callback_metrics)
    return module


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_callback_matches_plain_training(
    tmp_path: Path, spill: Path, restore_determinism: None, package: str
) -> None:
    callbacks = importlib.import_module(f"tierstore.integrations.{package}")

    expected = _lightning_train(tmp_path / "plain", [], package)
    callback = callbacks.TierstoreCallback(**_disk_settings(spill))
    got = _lightning_train(tmp_path / "offload", [callback], package)

    _assert_same_parameters(expected, got)
    assert callback.store is not None and callback.store.closed
    stats = callback.stats()
    assert stats.tiers["disk"].peak_bytes > 0
    assert stats.packed > 0 and stats.tiers["disk"].entries == 0
    assert list(spill.iterdir()) == []
    assert float(got.trainer_metrics["tierstore/disk_peak_bytes"]) > 0
    # training_step is the class's own again.
    assert "training_step" not in vars(got)


# -- imports --------------------------------------------------------------------------


def test_integrations_load_only_on_import_and_name_the_extra_when_missing() -> None:
    # One interpreter for all of it: each start imports torch.
    code = """
import sys
import tierstore
libs = ("tierstore.integrations", "transformers", "lightning", "pytorch_lightning")
print(sorted(m for m in sys.modules if m.startswith(libs)))
for lib in libs[1:]:
    sys.modules[lib] = None
for module in libs[1:]:
    try:
        __import__(f"tierstore.integrations.{module}")
    except ImportError as e:
        print(e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.splitlines() == [
        "[]",
        *(
            f"tierstore: tierstore.integrations.{lib} needs the {lib} package; "
            "install it with pip install 'tierstore[integrations]'"
            for lib in ("transformers", "lightning", "pytorch_lightning")
        ),
    ]
