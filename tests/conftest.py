from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded model, converted once per machine (see `python -m ucm.models prepare`)."""
    from ucm.models import prepare

    return prepare()


@pytest.fixture(scope="session")
def musique_path() -> Path:
    path = SHARED_DATA / "musique_dev.json"
    if not path.is_file():
        pytest.skip(f"evaluation data not present at {path}")
    return path
