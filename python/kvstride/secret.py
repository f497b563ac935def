"""The deployment secret of a shared store.

One file holds the key: at least 32 bytes of key material, written as hex (64 hex digits for
32 bytes; surrounding whitespace is ignored) or as raw bytes. Readable by its owner only
(mode 0600 or stricter): a file that group or others can read is refused, since whoever can
read it can forge values and compute keys.

``kvstride store serve --secret-file F`` creates F when it does not exist; every engine that
shares the store names the same file in ``kv_connector_extra_config["secret_file"]``. With the
secret, store keys are keyed hashes (SEMANTICS §3 "Keyed keys") and every Mooncake value carries
a keyed MAC over its key and payload (``kvstride.stores``), so a client of the store without
the secret can neither compute a key nor write a value an engine loads.
"""

from __future__ import annotations

import os
import secrets
import stat

__all__ = ["MIN_SECRET_BYTES", "load_secret", "generate_secret_file"]

MIN_SECRET_BYTES = 32

_FIX = "create one with `kvstride store serve --secret-file PATH` or kvstride.secret.generate_secret_file(PATH)"


def _key_material(raw: bytes) -> bytes:
    text = raw.strip()
    try:
        decoded = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return raw  # not hex: the file's bytes are the key
    return decoded


def load_secret(path) -> bytes:
    """The key in ``path``; ``ValueError`` naming the path and the fix when the file is missing
    or unreadable, readable by group or others, or holds fewer than 32 bytes of key material."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise ValueError(f"secret file {path!r} does not exist: {_FIX}") from None
    except OSError as e:
        raise ValueError(
            f"secret file {path!r} cannot be read ({e.strerror}): make it a regular file this user can read, "
            f"or {_FIX}"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"secret file {path!r} is not a regular file: {_FIX}")
        if st.st_mode & 0o077:
            raise ValueError(
                f"secret file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can access it; "
                f"run `chmod 600 {path}` (and replace the key if others may have read it)"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(1 << 16)
    finally:
        os.close(fd)
    key = _key_material(raw)
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(
            f"secret file {path!r} holds {len(key)} bytes of key material; at least {MIN_SECRET_BYTES} are "
            f"needed (e.g. 64 hex digits): {_FIX}"
        )
    if len(set(key)) == 1:
        raise ValueError(f"secret file {path!r} holds one byte value repeated, not a key: {_FIX}")
    return key


def generate_secret_file(path) -> bytes:
    """Write 32 random bytes as hex to ``path`` with mode 0600 (refusing to overwrite an
    existing file) and return the key."""
    path = os.fspath(path)
    key = secrets.token_bytes(MIN_SECRET_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (key.hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return key
