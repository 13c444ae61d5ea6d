"""Issue 21 item 9: SIGTERM when the SSD filesystem went read-only (ext4 ``errors=remount-ro``
after an error). Serving already failed closed; shutdown must not exit 1 with
``lmdb.Error: mdb_env_sync: Read-only file system``: one warning, exit status 0."""

from __future__ import annotations

from pathlib import Path

from readonly_disk import ext4_mount, make_read_only


def test_sigterm_with_read_only_ssd_exits_cleanly(make_daemon, tmp_path: Path) -> None:
    with ext4_mount(tmp_path) as mnt:
        daemon = make_daemon("--log-level", "info", ssd_dir=mnt / "ssd", ssd_size="16MiB")
        with daemon.client() as c:
            for i in range(32):  # DRAM-only blocks: the exit's flush will try to write them
                c.put(b"key-%d" % i, bytes([i]) * 65536)
        make_read_only(mnt)
        with daemon.client() as c:  # serving goes on: reads from DRAM stay exact
            assert c.get(b"key-3") == bytes([3]) * 65536
        num_lines = len(daemon.lines)
        rc = daemon.stop()
        exit_lines = daemon.lines[num_lines:]
        text = "\n".join(exit_lines)
        assert rc == 0, text
        assert "Traceback" not in text and "lmdb.Error" not in text, text
        warnings = [line for line in exit_lines if " WARNING " in line or " ERROR " in line]
        assert len(warnings) == 1, text
        assert "read-only" in warnings[0].lower(), warnings[0]
        assert "kvstore: stopped" in text
