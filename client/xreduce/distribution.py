"""``xreduce.distribution``: the ``keras.distribution`` utilities over the daemon (in progress)."""
