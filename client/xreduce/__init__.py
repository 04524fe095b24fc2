"""xreduce: the client SDK of the xreduce cross-device reduction daemon."""
