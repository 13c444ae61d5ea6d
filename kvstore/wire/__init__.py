"""The control protocol between engines and the daemon: framing, verbs, the client, the socket."""
