"""Real runs of playbooks/cluster.yml against three staged hosts on this machine (see staging.py):
what each role writes, that a second run changes nothing, and that --check writes nothing.
No systemd, packages, users or mounts are touched; nvidia-smi is a stand-in (no GPU here)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.playbooks.staging import (
    BIN,
    Cpu,
    PlaybookRun,
    RocePort,
    StagedHost,
    run_playbook,
    snapshot,
    stage,
    write_inventory,
)

# Each full run takes 30-60 s on two cores; the module runs the playbook four times.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("ansible-playbook", path=str(BIN)) is None,
        reason="ansible is not installed (pip install -e '.[test]')",
    ),
]

COMMON = {
    "dgpp_head_address": "127.0.0.1",
    "dgpp_rendezvous_port": 29600,
    "dgpp_engine_model": "SmolLM2-135M",
    "dgpp_engine_deployment": {"http": {"port": 18123}, "engine": {"kv_capacity": 4096}},
    "dgpp_engine_boundary_timeout_ms": 90000,
    "dgpp_engine_api_key": "test-api-key",
}


@dataclass
class Cluster:
    head: StagedHost
    workers: list[StagedHost]
    inventory: Path
    home: Path
    first: PlaybookRun
    second: PlaybookRun
    credentials_after_first: str

    @property
    def hosts(self) -> list[StagedHost]:
        return [self.head, *self.workers]


def staged_hosts(tmp: Path) -> tuple[StagedHost, list[StagedHost]]:
    """host0 (head) and host1 with cpufreq; host2 without, and with a GPU reading low; host0 with
    a CUDA toolkit's ptxas; host1 with both RoCE twins of its cluster link ACTIVE and the link at
    MTU 1500; host2 with one twin DOWN and the operator's own NCCL values."""
    cpus = [Cpu(), Cpu(), Cpu(cpuinfo_max_freq_khz=2_800_000), Cpu(cpuinfo_max_freq_khz=2_800_000)]
    head = StagedHost(
        "host0",
        0,
        tmp / "host0",
        tmp / "stand-in" / "host0",
        cpus=cpus,
        host_vars={"dgpp_cpu_governor_max_freq_khz": "3500000"},
    )
    workers = [
        StagedHost(
            "host1",
            1,
            tmp / "host1",
            tmp / "stand-in" / "host1",
            cpus=[Cpu(), Cpu()],
            roce_ports={
                "rocep1s0f0/1": RocePort("enp1s0f0np0"),
                "roceP2p1s0f0/1": RocePort("enP2p1s0f0np0", ipv4="0a0a:0101"),
            },
            interfaces={"enp1s0f0np0": 1500},
            host_vars={"dgpp_rdma_mtu_interface": "enp1s0f0np0"},
        ),
        StagedHost(
            "host2",
            2,
            tmp / "host2",
            tmp / "stand-in" / "host2",
            clocks_csv="1500, 300, 1500\n",
            roce_ports={
                "rocep1s0f1/1": RocePort("enp1s0f1np1"),
                "roceP2p1s0f1/1": RocePort("enP2p1s0f1np1", state="1: DOWN"),
            },
            host_vars={
                "dgpp_rdma_interface": "enp1s0f1np1",
                "dgpp_rdma_nccl_env": {"NCCL_IB_HCA": "=rocep1s0f1:1", "NCCL_IB_GID_INDEX": ""},
                "dgpp_engine_extra_env": {"GLOO_SOCKET_IFNAME": "lo"},
            },
        ),
    ]
    for host in (head, *workers):
        stage(host)
    head.path("/usr/local/cuda/bin").mkdir(parents=True)
    head.path("/usr/local/cuda/bin/ptxas").touch(mode=0o755)
    # The head has polkit (an empty stand-in polkitd), so the console's restart path is a rule.
    head.path("/usr/lib/polkit-1/polkitd").parent.mkdir(parents=True)
    head.path("/usr/lib/polkit-1/polkitd").touch()
    head.path("/etc/polkit-1/rules.d").mkdir(parents=True)
    return head, workers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    tmp = tmp_path_factory.mktemp("cluster")
    head, workers = staged_hosts(tmp)
    inventory = write_inventory(tmp / "inventory.yml", head, workers, **COMMON)
    first = run_playbook(inventory, tmp / "ansible")
    assert first.returncode == 0, first.output
    credentials = head.path("/etc/dgpp/webui.credentials").read_text()
    second = run_playbook(inventory, tmp / "ansible")
    assert second.returncode == 0, second.output
    return Cluster(head, workers, inventory, tmp / "ansible", first, second, credentials)


def env_file(host: StagedHost) -> dict[str, str]:
    text = host.path(f"/etc/dgpp/rank{host.rank}.env").read_text()
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def test_a_second_run_changes_nothing(cluster: Cluster):
    assert set(cluster.first.recap()) == {"host0", "host1", "host2"}
    assert all(counts["changed"] > 0 for counts in cluster.first.recap().values())
    assert {host: counts["changed"] for host, counts in cluster.second.recap().items()} == {
        "host0": 0,
        "host1": 0,
        "host2": 0,
    }, cluster.second.output


def test_gpu_clocks_are_locked_once_per_boot_head_lower_than_workers(cluster: Cluster):
    def locks(host: StagedHost) -> list[str]:
        return [call for call in host.nvidia_smi_calls() if call.startswith("-lgc")]

    assert locks(cluster.head) == ["-lgc 300,2300"]  # once: the second run found it applied
    assert [locks(worker) for worker in cluster.workers] == [["-lgc 300,2400"]] * 2
    assert cluster.head.path("/run/dgpp/gpu-clocks").read_text() == "300,2300\n"
    queries = [c for c in cluster.head.nvidia_smi_calls() if c.startswith("--query-gpu")]
    assert queries and "clocks.max.graphics,clocks.sm" in queries[0]


def test_clocks_are_read_back_and_a_low_gpu_is_flagged(cluster: Cluster):
    output = cluster.first.output
    assert (
        "host0 GPU 0 (limits 300,2300 MHz): clocks.max.graphics=2418 clocks.sm=300 "
        "clocks.applications.graphics=2418"
    ) in output
    assert "WARNING: host2 reads clocks.max.graphics 1500.0 MHz" in output
    assert "WARNING: host0" not in output and "WARNING: host1" not in output


def test_a_low_gpu_fails_the_run_when_asked(cluster: Cluster):
    run = run_playbook(
        cluster.inventory,
        cluster.home,
        "--limit=host2",
        "--tags=dgpp_gpu_clocks",
        "-e",
        "dgpp_gpu_clocks_on_low=fail",
    )
    assert run.returncode != 0
    assert "host2 reads clocks.max.graphics 1500.0 MHz" in run.output


def test_tune_env_persists_the_settings_for_the_boot_unit(cluster: Cluster):
    head, host1, host2 = cluster.hosts
    tune = head.path("/etc/dgpp/tune.env").read_text().splitlines()
    assert f"DGPP_NVIDIA_SMI={head.nvidia_smi}" in tune
    assert "DGPP_GPU_CLOCKS=300,2300" in tune
    assert "DGPP_CPU_GOVERNOR=performance" in tune
    assert "DGPP_CPU_MAX_FREQ_KHZ=3500000" in tune
    assert "DGPP_GPU_CLOCKS=300,2400" in host1.path("/etc/dgpp/tune.env").read_text()
    assert "DGPP_CPU_GOVERNOR" not in host2.path("/etc/dgpp/tune.env").read_text()
    for host in cluster.hosts:
        script = host.path("/usr/local/libexec/dgpp/dgpp-tune")  # as the unit's ExecStart says
        assert stat.S_IMODE(script.stat().st_mode) == 0o755
        assert host.path("/etc/systemd/system/dgpp-tune.service").is_file()


def test_cpu_governor_and_capped_max_frequency_are_written(cluster: Cluster):
    cpus = cluster.head.path("/sys/devices/system/cpu")
    governors = [(cpus / f"cpu{i}/cpufreq/scaling_governor").read_text().strip() for i in range(4)]
    max_freqs = [(cpus / f"cpu{i}/cpufreq/scaling_max_freq").read_text().strip() for i in range(4)]
    assert governors == ["performance"] * 4
    assert max_freqs == ["3500000", "3500000", "2800000", "2800000"]  # cpu2, cpu3 top out lower
    host1_cpus = cluster.workers[0].path("/sys/devices/system/cpu")
    assert (host1_cpus / "cpu1/cpufreq/scaling_governor").read_text().strip() == "performance"
    assert (host1_cpus / "cpu1/cpufreq/scaling_max_freq").read_text().strip() == "3000000"
    assert (
        "cpu*/cpufreq not found: the CPU governor on host2 is left as it is" in cluster.first.output
    )


def test_head_exports_the_weights_and_workers_mount_them(cluster: Cluster):
    exports = cluster.head.path("/etc/exports.d/dgpp.exports").read_text().splitlines()
    options = "ro,no_subtree_check,root_squash,sec=sys"
    assert f"/srv/dgpp/models host1({options}) host2({options})" in exports
    assert "nfs" not in cluster.head.path("/etc/fstab").read_text()
    for worker in cluster.workers:
        assert not worker.path("/etc/exports.d/dgpp.exports").exists()
        lines = [line.split() for line in worker.path("/etc/fstab").read_text().splitlines()]
        mounts = [line for line in lines if line and line[0] == "127.0.0.1:/srv/dgpp/models"]
        assert len(mounts) == 1, lines
        _, mount_point, fstype, opts, *_ = mounts[0]
        assert (mount_point, fstype) == ("/srv/dgpp/models", "nfs")
        assert {"ro", "noatime", "nconnect=8", "rsize=1048576"} <= set(opts.split(","))


def test_rdma_limits_mtu_and_link_report(cluster: Cluster):
    head, host1, _ = cluster.hosts
    for host in cluster.hosts:
        limits = host.path("/etc/security/limits.d/90-dgpp-rdma.conf").read_text().splitlines()
        assert {"* soft memlock unlimited", "root hard memlock unlimited"} <= set(limits)
    assert host1.ip_calls() == ["link set dev enp1s0f0np0 mtu 9000"]  # once: then it read 9000
    assert host1.path("/sys/class/net/enp1s0f0np0/mtu").read_text().strip() == "9000"
    rule = host1.path("/etc/udev/rules.d/70-dgpp-mtu.rules").read_text()
    assert 'KERNEL=="enp1s0f0np0", ATTR{mtu}="9000"' in rule
    assert not head.path("/etc/udev/rules.d/70-dgpp-mtu.rules").exists() and not head.ip_calls()
    assert "host1: 2 ACTIVE RDMA port(s). roce" in cluster.first.output
    assert "host0: 0 ACTIVE RDMA port(s). No RDMA devices found." in cluster.first.output


def test_every_rank_gets_its_environment_file(cluster: Cluster):
    for host in cluster.hosts:
        env = env_file(host)
        assert env["DGPP_RANK"] == str(host.rank)
        assert env["DGPP_HEAD"] == "127.0.0.1"
        assert env["DGPP_RENDEZVOUS_PORT"] == "29600"
        assert env["DGPP_BOUNDARY_TIMEOUT_MS"] == "90000"
        assert ("DGPP_DEPLOYMENT" in env) == (host is cluster.head)
        assert env["DGPP_CLUSTER_SECRET_FILE"] == "/etc/dgpp/cluster-secret"
        # The disk tier's folder: on the node's disk, the ranks' alone.
        assert env["DGPP_PREFIX_CACHE_DIR"] == "/var/cache/dgpp/prefix"
        folder = host.path("/var/cache/dgpp/prefix")
        assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700
        mode = host.path(f"/etc/dgpp/rank{host.rank}.env").stat().st_mode
        assert stat.S_IMODE(mode) == 0o640
    assert env_file(cluster.head)["DGPP_DEPLOYMENT"] == "/etc/dgpp/deployment.json"


def test_rank_files_get_nccl_s_environment_and_the_toolkit(cluster: Cluster):
    head, host1, host2 = cluster.hosts
    env1, env2, output = env_file(host1), env_file(host2), cluster.first.output
    assert env1["NCCL_IB_HCA"] == "=rocep1s0f0:1,roceP2p1s0f0:1"  # both twins, exact names
    assert env1["NCCL_IB_GID_INDEX"] == "3"  # RoCE v2, IPv4-mapped
    assert env1["NCCL_SOCKET_IFNAME"] == env1["GLOO_SOCKET_IFNAME"] == "enp1s0f0np0"
    assert "WARNING: host1" not in output  # twins ACTIVE, MTU 9000 by then
    # The operator's values win ("" leaves a variable out), dgpp_engine_extra_env over both.
    assert env2["NCCL_IB_HCA"] == "=rocep1s0f1:1" and "NCCL_IB_GID_INDEX" not in env2
    assert (env2["NCCL_SOCKET_IFNAME"], env2["GLOO_SOCKET_IFNAME"]) == ("enp1s0f1np1", "lo")
    assert "WARNING: host2 warn rdma.twins: one twin in use behind enp1s0f1np1" in output
    assert not any(name.startswith(("NCCL_", "GLOO_")) for name in env_file(head))
    assert env_file(head)["DGPP_CUDA_HOME"] == "/usr/local/cuda"  # its bin/ptxas exists
    assert "DGPP_CUDA_HOME" not in env2


def test_the_head_gets_its_firewall_and_the_workers_none(cluster: Cluster):
    ruleset = cluster.head.path("/etc/dgpp/firewall.nft").read_text()
    assert "table inet dgpp {" in ruleset
    assert "tcp dport 29600 ip saddr @cluster_v4 accept" in ruleset
    assert "tcp dport 29600 drop" in ruleset
    assert "tcp dport 18123" not in ruleset  # no client networks given: the API stays open
    unit = cluster.head.path("/etc/systemd/system/dgpp-firewall.service")
    if shutil.which("nft"):  # checked with the real nft, and loadable: the unit is installed
        assert "ExecStart=/usr/sbin/nft -f /etc/dgpp/firewall.nft" in unit.read_text()
    else:
        assert not unit.exists() and "is written but not loaded" in cluster.first.output
    for worker in cluster.workers:
        assert not worker.path("/etc/dgpp/firewall.nft").exists()
        assert not worker.path("/etc/systemd/system/dgpp-firewall.service").exists()


def test_every_node_holds_the_same_generated_cluster_secret(cluster: Cluster):
    from dgpp.appliance.runtime.cluster_secret_file import read_cluster_secret

    secrets = set()
    for host in cluster.hosts:
        path = host.path("/etc/dgpp/cluster-secret")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the ranks' user alone
        secret = read_cluster_secret(str(path), {})
        assert secret is not None and len(secret) == 64
        secrets.add(secret)
    assert len(secrets) == 1  # made once on the head (the second run kept it), copied to all
    (secret,) = secrets
    assert secret.decode() not in cluster.first.output + cluster.second.output


def test_the_head_gets_a_valid_deployment_shaped_by_the_inventory(cluster: Cluster):
    from dgpp.appliance.deployments.deployment import parse_deployment

    path = cluster.head.path("/etc/dgpp/deployment.json")
    deployment = parse_deployment(json.loads(path.read_text()))
    assert deployment.world_size == 3
    assert (deployment.rendezvous.head, deployment.rendezvous.port) == ("127.0.0.1", 29600)
    assert deployment.model == "/srv/dgpp/models/SmolLM2-135M"
    assert (deployment.http.port, deployment.engine.kv_capacity) == (18123, 4096)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not any(w.path("/etc/dgpp/deployment.json").exists() for w in cluster.workers)
    # The key went into its own file, which the deployment names; no admin key was given.
    assert deployment.http.api_key_file == "/etc/dgpp/api-key"
    assert deployment.http.admin_key_file is None
    key_file = cluster.head.path("/etc/dgpp/api-key")
    assert key_file.read_text() == "test-api-key\n"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o640
    assert not cluster.head.path("/etc/dgpp/admin-key").exists()
    assert "test-api-key" not in cluster.first.output + cluster.second.output


def test_an_invalid_deployment_is_refused_and_the_old_one_kept(cluster: Cluster):
    path = cluster.head.path("/etc/dgpp/deployment.json")
    before = path.read_text()
    bad = {**COMMON["dgpp_engine_deployment"], "engine": {"kv_capacity": "lots"}}
    run = run_playbook(
        cluster.inventory,
        cluster.home,
        "--limit=host0",
        "--tags=dgpp_engine",
        "-e",
        json.dumps({"dgpp_engine_deployment": bad}),
    )
    assert run.returncode != 0
    assert "engine.kv_capacity" in run.output
    assert path.read_text() == before


def test_units_and_console_credentials(cluster: Cluster):
    from dgpp.webui.security.credentials import load_credentials

    for host in cluster.hosts:
        units = host.path("/etc/systemd/system")
        assert (units / "dgpp@.service").is_file() and (units / "dgpp.target").is_file()
        assert (units / "dgpp-webui.service").exists() == (host is cluster.head)
    credentials = cluster.head.path("/etc/dgpp/webui.credentials")
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    text = credentials.read_text()
    assert text == cluster.credentials_after_first  # created once, never rewritten
    values = dict(line.split("=", 1) for line in text.splitlines())
    assert set(values) == {"DGPP_WEBUI_USER", "DGPP_WEBUI_PASSWORD_HASH"}  # no plain text
    assert values["DGPP_WEBUI_PASSWORD_HASH"].startswith("scrypt$")
    # The generated password, for root alone, is the one the hash accepts.
    password_file = cluster.head.path("/etc/dgpp/webui.initial-password")
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    password = password_file.read_text().strip()
    assert len(password) == 24 and password.isalnum()
    assert load_credentials(credentials).verify("admin", password)
    assert password not in cluster.first.output and password not in cluster.second.output
    assert not cluster.workers[0].path("/etc/dgpp/webui.credentials").exists()


def test_console_settings_select_systemd_and_polkit(cluster: Cluster):
    from dgpp.webui.core.config import load_console_config

    head = cluster.head
    env = head.path("/etc/dgpp/webui.env").read_text().splitlines()
    assert "DGPP_WEBUI_CONFIG=/etc/dgpp/webui.json" in env
    config = load_console_config(head.path("/etc/dgpp/webui.json"), {})
    assert (config.backend, config.host, config.port) == ("systemd", "127.0.0.1", 18090)
    assert str(config.deployment) == "/etc/dgpp/deployment.json"
    assert str(config.credentials) == "/etc/dgpp/webui.credentials"
    assert str(config.state_dir) == "/var/lib/dgpp-webui"
    assert config.systemctl == ("systemctl",)  # polkit: no sudo in front
    assert head.path("/var/lib/dgpp-webui").is_dir()
    assert stat.S_IMODE(head.path("/var/lib/dgpp-webui").stat().st_mode) == 0o700
    assert "DGPP_LOG_DIR=/var/lib/dgpp/dgpp/log" in env  # the ranks' logs, for the Logs page
    rule = head.path("/etc/polkit-1/rules.d/50-dgpp-webui.rules").read_text()
    assert 'action.lookup("unit") === "dgpp@rank0.service"' in rule
    assert f'subject.user === "{pwd.getpwuid(os.getuid()).pw_name}"' in rule  # dgpp_webui_user
    assert not head.path("/etc/sudoers.d/dgpp-webui").exists()
    # A staged /etc/dgpp belongs to the test's user, who is dgpp_user here: no warning.
    assert "cannot replace /etc/dgpp/deployment.json" not in cluster.first.output


def test_check_mode_on_fresh_hosts_writes_nothing(tmp_path: Path):
    head, workers = staged_hosts(tmp_path)
    inventory = write_inventory(tmp_path / "inventory.yml", head, workers, **COMMON)
    before = {host.name: snapshot(host.root) for host in (head, *workers)}
    run = run_playbook(inventory, tmp_path / "ansible", "--check", "--diff")
    assert run.returncode == 0, run.output
    assert all(counts["changed"] > 0 for counts in run.recap().values())  # it saw the work
    assert {host.name: snapshot(host.root) for host in (head, *workers)} == before
    assert not any(c.startswith("-lgc") for h in (head, *workers) for c in h.nvidia_smi_calls())
