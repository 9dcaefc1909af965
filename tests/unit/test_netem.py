"""Quick checks of scripts/netem.py that need no namespaces and no privileges."""
import ipaddress

import pytest

from scripts_under_test import load_script

netem = load_script("netem")


def test_parse_splits_command_at_double_dash():
    args, cmd = netem.parse_args(["--rate", "1gbit", "-np", "3", "--", "python", "x.py", "--n", "5"])
    assert args.rate == "1gbit" and args.np == 3
    assert cmd == ["python", "x.py", "--n", "5"]
    assert args.subnet == ipaddress.IPv4Network("198.18.0.0/24")


@pytest.mark.parametrize("text", ["none", "None", "loopback"])
def test_rate_none(text):
    args, _ = netem.parse_args(["--rate", text, "-np", "2", "--", "true"])
    assert args.rate == "none"


@pytest.mark.parametrize("argv", [
    ["--rate", "fast", "-np", "2", "--", "true"],            # not a tc rate
    ["--rate", "1gbit", "-np", "0", "--", "true"],           # no ranks
    ["--rate", "1gbit", "-np", "2"],                         # no command
    ["--rate", "1gbit", "-np", "2", "--subnet", "8.8.8.0/24", "--", "true"],   # public range
    ["--rate", "1gbit", "-np", "20", "--subnet", "10.1.1.0/28", "--", "true"],  # too small
])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        netem.parse_args(argv)
    assert e.value.code == 2


def test_refuses_without_root():
    with pytest.raises(netem.PrivilegeError, match="needs root"):
        netem.check_privileges(euid=1000)


def test_main_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    rc = netem.main(["--rate", "1gbit", "-np", "2", "--", "true"])
    assert rc == netem.EXIT_NO_PRIVILEGE
    assert "refusing to run" in capsys.readouterr().err


def test_dry_run_plan_changes_nothing(capsys):
    rc = netem.main(["--rate", "10gbit", "-np", "2", "--dry-run", "--", "python", "b.py"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "tbf rate 10gbit burst 256kb latency 50ms" in err
    assert "PMIX_MCA_ptl_tcp_if_include=198.18.0.0/24" in err
    assert "btl_tcp_if_include 198.18.0.0/24" in err


def test_mpirun_command_loopback():
    args, cmd = netem.parse_args(["--rate", "none", "-np", "2", "--", "python", "b.py"])
    argv, env = netem.mpirun_command(args, cmd, None)
    assert argv[:2] == ["mpirun", "--allow-run-as-root"]
    assert argv[-2:] == ["python", "b.py"]
    assert env[netem.RATE_ENV] == "loopback"
