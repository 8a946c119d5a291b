import pytest

from regent.jobs.base import SECRET_ENV


@pytest.fixture(autouse=True)
def _isolated_job_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep secrets set or exported by job tests from leaking into other tests."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
