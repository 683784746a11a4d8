"""wait_for_replica_group: the file handoff of a warm standby."""

import threading
import time

import pytest

from torchft_like.standby import wait_for_replica_group


def test_waits_until_the_file_appears(tmp_path):
    path = tmp_path / "standby"

    def write_later() -> None:
        time.sleep(0.1)  # late on purpose: the wait must last this long
        (tmp_path / "standby.tmp").write_text("3\n")
        (tmp_path / "standby.tmp").rename(path)

    writer = threading.Thread(target=write_later)
    started = time.monotonic()  # before the writer's sleep can begin
    writer.start()
    assert wait_for_replica_group(path, poll_s=0.005) == 3
    assert time.monotonic() - started >= 0.1
    writer.join()


@pytest.mark.parametrize("content", ["", "one", "-1", "1.5", "1 2"])
def test_anything_but_a_group_id_is_refused_with_the_file_named(tmp_path, content):
    path = tmp_path / "standby"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"standby file .*standby.* not a replica group id"):
        wait_for_replica_group(path)
