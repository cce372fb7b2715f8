"""The exception classes of ringsync: one base, a usage kind and a communication kind.
Horovod's code catches RuntimeError for both of the kinds it raises at synchronize (its
HorovodInternalError, and mismatches between ranks): ours are RuntimeErrors too."""


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


class CommunicationError(RingsyncError, RuntimeError):
    """A peer was lost or a connection broke. Recoverable: the communicator must be
    shut down and built again (elastic recovery does this) before the next collective."""


class CommunicationTimeout(CommunicationError):
    """No progress before RINGSYNC_TIMEOUT_SECONDS passed."""


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
