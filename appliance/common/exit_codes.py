"""Process exit codes of `dgpp` (documented in docs/operations.md; systemd units rely on them)."""

EXIT_OK = 0  # orderly stop (also SIGTERM / SIGINT)
EXIT_ERROR = 1  # an unexpected error, or a runtime error that is not configuration (e.g. offline)
EXIT_USAGE = 2  # bad command line
EXIT_CONFIG = 3  # the configuration cannot work: invalid deployment or knob, a model that
#                  cannot load, a world that refuses this rank; restarting alone will not help
EXIT_ENGINE_FAILURE = 4  # the engine broke in a way this process cannot recover from in place
#                          (a step overran its watchdog); the supervisor restarts it
EXIT_INTERRUPTED = 130
