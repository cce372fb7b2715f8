"""Every exception class of ringsync, and the one table from the native core's statuses to
them: one base, a usage kind and a communication kind. Horovod's code catches RuntimeError
for both of the kinds it raises at synchronize (its HorovodInternalError, and mismatches
between ranks): ours are RuntimeErrors too. Pure Python (no native import), so that
`import ringsync` and the launcher work where the core is not built."""


class RingsyncError(Exception):
    """Base class of every error ringsync raises."""


class UsageError(RingsyncError, ValueError):
    """Bad input or a call at the wrong time. Nothing is broken: the next call works."""


class NotInitializedError(UsageError):
    """A collective or query was called before ringsync.init()."""


class MismatchError(UsageError, RuntimeError):
    """A collective refused once the ranks compared their calls: they disagreed about it
    (shape, dtype, op, root, ...), or it cannot run now (e.g. while a rank has joined).
    A RuntimeError too, as Horovod's are at synchronize; nothing is broken: the next
    call works."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be saved or loaded: which file, which rank, what is wrong."""


class LauncherError(RingsyncError):
    """A problem the user can fix: no mpirun, a bad -H value, an unreadable hostfile."""


class OutOfMemoryError(RingsyncError, MemoryError):
    """The native core could not allocate what a call needed. Nothing is broken: the next
    call (with less memory, or after memory was freed) works."""


class CommunicationError(RingsyncError, RuntimeError):
    """A peer was lost or a connection broke. Recoverable: the communicator must be
    shut down and built again (elastic recovery does this) before the next collective."""


class CommunicationTimeout(CommunicationError):
    """No progress before RINGSYNC_TIMEOUT_SECONDS passed."""


class StoreLostError(CommunicationError):
    """The key-value store a job meets through (ringsync.store) is gone, or never
    answered: the job cannot agree on anything any more, so elastic recovery does not
    try; every rank ends with this error, which names the store and who served it."""


# Horovod's name for the recoverable kind, so that Horovod-style elastic code reads the same.
HorovodInternalError = CommunicationError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's name: raised by an elastic State's commit() (check_host_updates) on every
    rank when host discovery found hosts added or gone; ringsync.elastic.run catches it,
    resizes the job, and goes on from the live state (no roll-back). skip_sync: as
    Horovod's (the state is synced to the new ranks either way: they have none)."""

    def __init__(self, skip_sync=False, hosts=None, leaving=()):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync
        self.hosts = dict(hosts or {})  # host -> ranks to start there
        self.leaving = list(leaving)  # ranks that leave the job


# The native statuses (ringsync.h rs_status_t) by number: this module may not import the
# core (see above), and _native's import checks that these numbers match ringsync.h.
STATUS_CODES = {"RS_ERR_USAGE": 1, "RS_ERR_NOMEM": 2, "RS_ERR_COMM": 3, "RS_ERR_TIMEOUT": 4,
                "RS_ERR_SYSTEM": 5}
_STATUS_ERRORS = {1: UsageError, 2: OutOfMemoryError, 3: CommunicationError,
                  4: CommunicationTimeout, 5: CommunicationError}


def error_class(status: int, usage_kind=UsageError) -> type:
    """The class a failed native status is raised as. usage_kind: what a usage error means
    where it was found (MismatchError once the ranks compared their calls)."""
    if status == STATUS_CODES["RS_ERR_USAGE"]:
        return usage_kind
    return _STATUS_ERRORS.get(status, CommunicationError)
