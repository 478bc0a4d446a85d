"""A power-loss harness: trace a process's file-system calls, build every disk state a power
cut may leave between its sync barriers, and check that the store recovers from each one.

- :mod:`.trace` runs a command under ``strace`` and turns the calls that touch a watched folder
  into inode-level operations (data writes, namespace changes, sync barriers, markers);
- :mod:`.model` builds the crash states from those operations under a stated persistence model
  and writes each one to disk;
- :mod:`.child` holds the traced scenarios (store commits, a folder list, snapshots, a
  training run, the reopen that recovers) and the planted ordering bug the harness must find;
- :mod:`.check` records a scenario and checks every crash state, and those of a power cut
  during the recovery.
"""
