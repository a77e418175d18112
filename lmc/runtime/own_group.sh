#!/bin/sh
# The executable multiprocessing spawns through while lmc.runtime.process_group.own_group() is active: the
# new process leaves its parent's process group (lmc.runtime.process_group.main), then becomes the Python
# it was meant to be.
exec "${LMC_OWN_GROUP_PYTHON:?set by lmc.runtime.process_group.own_group}" -m lmc.runtime.process_group "$@"
