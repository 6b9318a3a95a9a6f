"""The one exception type for errors a user can cause; the CLI prints it without a traceback.

Also the translation every module needs: an OSError a user can cause (a full disk, no
permission, a read-only mount) into one sentence naming the path.
"""

from __future__ import annotations

import errno


class KilnError(Exception):
    """A user-facing error: bad config, bad data, bad path. The message names what and where."""


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
# Errors that retrying cannot fix: a full disk, a quota, no permission, a read-only mount.
PERMANENT = (*FULL_DISK, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR)


def os_error(e: OSError, what: str) -> KilnError:
    """One paragraph for an OSError while `what` ('writing shards to out/web', ...)."""
    path = f" ({e.filename})" if e.filename else ""
    if e.errno in FULL_DISK:
        kind = "no space left on the device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return KilnError(f"{what}: {kind}{path}; free some space (or choose another location) "
                         "and run the command again")
    if e.errno in (errno.EACCES, errno.EPERM):
        return KilnError(f"{what}: permission denied{path}")
    if e.errno == errno.EROFS:
        return KilnError(f"{what}: the file system is read-only{path}")
    return KilnError(f"{what}: {e.strerror or e}{path}")


def full_disk_in(error: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError in an exception's chain, if there is one."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL_DISK:
            return error
        error = error.__cause__ or error.__context__
    return None


class Preempted(Exception):
    """The run stopped at a step boundary on a signal (preemption, a time limit) with its
    checkpoint committed; the CLI exits with kiln.train.guards.EXIT_RESTART (75) so that a
    launcher restarts it, and the restarted run resumes from that checkpoint."""
