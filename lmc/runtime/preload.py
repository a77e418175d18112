"""Imported first, and only, by the fork server that worker ranks are forked from (see
workers.start_process_server): it switches the cyclic garbage collector off for the preload, and makes
the server ignore SIGTERM.

Importing torch and transformers allocates millions of objects and none of them is garbage, yet the
collector keeps scanning them: about a fifth of the import time on a small CPU. Each rank turns the
collector back on right after the fork (workers.worker_main), with everything imported frozen out of
its reach.

SIGTERM: a signal sent to the container's whole process group must not take the server down while the
front end drains. start_process_server starts the first server with SIGTERM ignored; multiprocessing
starts a new one by itself when a rank is started after the server died, from a supervisor thread
that cannot change signal dispositions, so the server sets its own here. Never import this module
anywhere else.
"""

import gc
import signal

gc.disable()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
