"""User errors cross process boundaries (a sweep cell's error reaches the sweep's process by pickle) unchanged."""

import pickle

import pytest

from cat.classification.loops import NonFiniteLossError
from cat.errors import ConfigError, DataError, SweepCellError, UserError
from cat.mm import MissingStackError
from cat.models.loading import CheckpointMismatchError, LoadReport, UnsafeCheckpointError

ERRORS = [
    ConfigError("lr=-1: expected a number > 0"),
    ConfigError(["lr=-1: expected a number > 0", "epochs=0: expected an integer > 0"]),
    CheckpointMismatchError(LoadReport(missing=["head.weight"]), "best.pth"),
    CheckpointMismatchError(LoadReport(unexpected=["model.norm.weight"]), "best.pth", hint="see model.pretrained="),
    UnsafeCheckpointError("the file references os.system"),
    MissingStackError("detection needs the OpenMMLab stack"),
    NonFiniteLossError("loss is nan at step 3"),
    DataError("no such folder: /data/imagenet/train"),
    SweepCellError("sweep cell lr=-1: invalid config: lr=-1: expected a number > 0"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_a_user_error_pickles_as_itself(error: UserError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert vars(again) == vars(error)
