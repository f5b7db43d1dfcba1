"""The daemon's processes: supervisor, front-end, scheduler, workers."""
