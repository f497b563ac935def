"""kvstride.secret: the deployment key file."""

import os

import pytest

from kvstride.secret import generate_secret_file, load_secret


def test_generate_then_load(tmp_path):
    path = tmp_path / "key"
    key = generate_secret_file(path)
    assert len(key) == 32
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_secret(path) == key
    assert path.read_text().strip() == key.hex()
    with pytest.raises(FileExistsError):
        generate_secret_file(path)  # never overwrites a deployment's key


def test_missing_file_names_the_path_and_the_fix(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"nope.*does not exist.*--secret-file"):
        load_secret(path)


def test_group_or_other_readable_is_refused(tmp_path):
    path = tmp_path / "key"
    generate_secret_file(path)
    for mode in (0o640, 0o604, 0o644):
        os.chmod(path, mode)
        with pytest.raises(ValueError, match=r"key.*chmod 600"):
            load_secret(path)


@pytest.mark.parametrize("content", [b"", b"ab" * 31, b"short raw key", b"\0" * 64, (b"11" * 32)])
def test_weak_keys_are_refused(tmp_path, content):
    path = tmp_path / "key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(ValueError, match=r"key"):
        load_secret(path)


def test_raw_key_bytes_are_accepted(tmp_path):
    path = tmp_path / "key"
    raw = bytes(range(1, 41))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, raw)
    os.close(fd)
    assert load_secret(path) == raw


def test_unreadable_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = tmp_path / "key"
    generate_secret_file(path)
    os.chmod(path, 0o000)
    with pytest.raises(ValueError, match=r"cannot be read"):
        load_secret(path)
