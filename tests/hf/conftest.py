import pytest

from ._hf import make_trainer


@pytest.fixture(scope="session")
def reference_10(tmp_path_factory):
    """Weights after 10 uninterrupted steps of the stock Trainer (save_steps=3)."""
    trainer = make_trainer(str(tmp_path_factory.mktemp("reference") / "run"), max_steps=10, save_steps=3)
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]
