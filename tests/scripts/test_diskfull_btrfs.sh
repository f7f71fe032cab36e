#!/usr/bin/env bash
# test_diskfull_btrfs.sh: test_diskfull.sh on btrfs, a copy-on-write file system, where zeros
# written ahead of the log once made the log's writes fail for space on a full disk (fatal for
# the store, where it must answer FULL).
IDEM_DISKFULL_FS=btrfs exec bash "$(dirname "$0")/test_diskfull.sh"
