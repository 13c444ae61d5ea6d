"""What keeps an HTTP server of ours up against its clients: a cap on open connections, a bound
on a request's arrival, a log that an attack cannot flood. The engine's OpenAI API
(``server/http_front.py``) and the daemon's admin app (``kvstore/daemon/admin.py``) both serve
through it."""
