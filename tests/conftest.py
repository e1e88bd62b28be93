from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Read-only fixtures beside the checkout in development and CI; absent on users' machines.
SHARED = REPO.parent / "shared"
OFFICIAL_CA_DEIT = SHARED / "fixtures" / "official_ca_deit"


@pytest.fixture
def official_ca_deit() -> Path:
    if not (OFFICIAL_CA_DEIT / "small_p8_64.pth").is_file():
        pytest.skip("../shared/fixtures/official_ca_deit is not present")
    return OFFICIAL_CA_DEIT


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
