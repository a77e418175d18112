"""Imported first, and only, by the fork server that worker ranks are forked from (see
workers.start_process_server): it switches the cyclic garbage collector off for the preload.

Importing torch and transformers allocates millions of objects and none of them is garbage, yet the
collector keeps scanning them: about a fifth of the import time on a small CPU. Each rank turns the
collector back on right after the fork (workers.worker_main), with everything imported frozen out of
its reach. Never import this module anywhere else.
"""

import gc

gc.disable()
