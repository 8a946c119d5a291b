"""This user's default job secret (`regent.auth.user_secret`): made 0600 on first use and the same afterwards, so a
client and a worker given no secret agree; refused when others could read it; off on request."""

import os
import threading

import pytest

from regent.auth import InsecureSecretFile, user_secret, user_secret_path


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    monkeypatch.delenv("REGENT_USER_SECRET_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


def test_made_private_on_first_use_and_the_same_afterwards(config_home):
    path = user_secret_path()
    assert path == str(config_home / "regent" / "job-secret")
    first = user_secret()
    assert len(first) == 32
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    assert user_secret() == first
    assert os.listdir(os.path.dirname(path)) == ["job-secret"]  # no temporary file left behind


def test_processes_making_it_at_once_all_get_the_one_that_landed(config_home):
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(user_secret())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    with open(user_secret_path()) as f:
        assert bytes.fromhex(f.read()) == got[0]


@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_a_file_others_can_read_is_refused_with_the_fix(config_home, mode):
    user_secret()
    os.chmod(user_secret_path(), mode)
    with pytest.raises(InsecureSecretFile) as refused:
        user_secret()
    message = str(refused.value)
    assert "\n" not in message
    assert f"can be read by other users (mode {mode:o})" in message
    assert f"chmod 600 {user_secret_path()}" in message


def test_an_explicit_path_and_off(tmp_path, monkeypatch):
    monkeypatch.setenv("REGENT_USER_SECRET_FILE", str(tmp_path / "mine"))
    assert user_secret_path() == str(tmp_path / "mine")
    assert len(user_secret()) == 32
    for word in ("off", "0", "none"):
        monkeypatch.setenv("REGENT_USER_SECRET_FILE", word)
        assert user_secret_path() is None and user_secret() is None
