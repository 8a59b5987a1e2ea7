"""Files on disk: crash-safe writes, the JSON records minirl reads back, and the run folder's one owner."""
