"""Checks the production deployment artefacts (Dockerfile, deploy/k8s, deploy/compose.yaml)
against the code they deploy, without a cluster or a container engine: every manifest
against the Kubernetes schemas (kubernetes-validate) and KEDA's (its npm models), every
variable they set against the variables the binaries read, every port, probe path,
consumer group and topic against the ones the services use (docs/deploy.md)."""

import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES_VERSION = "1.33"
KEDA_MODELS_VERSION = "2.0.0"
KUSTOMIZE_VERSION = "5.7.1"

# The binaries a production deployment runs, and the service each one is.
SERVICE_BINARIES = {
    "fenceline-intake": "intake",
    "fenceline-scheduler": "scheduler",
    "fenceline-executor": "executor",
    "fenceline-reconciler": "reconciler",
}
ADMIN_BINARY = "fenceline-admin"


# --- what the code reads and serves ---------------------------------------------------


@functools.cache
def cargo_metadata():
    out = subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


@functools.cache
def workspace_binaries():
    """Binary name -> (package name, crate directory)."""
    found = {}
    for package in cargo_metadata()["packages"]:
        for target in package["targets"]:
            if "bin" in target["kind"]:
                found[target["name"]] = (package["name"], pathlib.Path(package["manifest_path"]).parent)
    return found


def package_closure(package_name):
    """The workspace packages a package depends on, itself included."""
    packages = {p["name"]: p for p in cargo_metadata()["packages"]}
    seen, todo = set(), [package_name]
    while todo:
        name = todo.pop()
        if name in seen or name not in packages:
            continue
        seen.add(name)
        todo.extend(d["name"] for d in packages[name]["dependencies"] if d["kind"] is None)
    return [pathlib.Path(packages[name]["manifest_path"]).parent for name in sorted(seen)]


def rust_sources(crate_dir):
    return sorted((crate_dir / "src").rglob("*.rs"))


def strip_comments(text):
    return re.sub(r"^\s*//.*$", "", text, flags=re.M)


ATTRIBUTE = re.compile(r"#\[(arg|command)\((.*?)\)\]", re.S)
FIELD = re.compile(r"((?:\s*#\[(?:arg|command|serde)\(.*?\)\])+)\s*(?:pub\s+)?(\w+)\s*:\s*([^,\n]+),", re.S)
ITEM = re.compile(r"\b(?:struct|enum)\s+(\w+)[^{;]*\{(.*?)\n\}", re.S)


def clap_items(files):
    """Every struct and enum body of these files, by name, as (attributes, field, type) triples."""
    items = {}
    for path in files:
        text = strip_comments(path.read_text())
        for item in ITEM.finditer(text):
            fields = [(attrs, name, ty.strip()) for attrs, name, ty in FIELD.findall(item.group(2))]
            items.setdefault(item.group(1), fields)
    return items


@functools.cache
def binary_variables(binary):
    """(every variable the binary reads, the ones it requires) from its clap
    configuration (`env = "..."`), its std::env reads and its dependencies'."""
    package, crate = workspace_binaries()[binary]
    closure = package_closure(package)
    own = clap_items(rust_sources(crate))
    shared = clap_items(f for d in closure if d != crate for f in rust_sources(d))
    main = strip_comments((crate / "src" / "main.rs").read_text())
    derived = re.search(r"#\[derive\([^)]*\bParser\b[^)]*\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub\s+)?struct\s+(\w+)", main)
    root = derived.group(1) if derived else re.search(r"(\w+)::parse\(\)", main).group(1)

    reads, required = set(), set()

    def walk(name, top_level):
        fields = own[name] if name in own else shared.get(name)
        assert fields is not None, f"{binary}: cannot find the configuration type {name}"
        for attrs, _field, ty in fields:
            nested = re.search(r"#\[command\((flatten|subcommand)\)\]", attrs)
            if nested:
                inner = re.sub(r"^Option<(.*)>$", r"\1", ty).split("::")[-1]
                walk(inner, top_level and nested.group(1) == "flatten")
                continue
            env = re.search(r'\benv\s*=\s*"([A-Z0-9_]+)"', attrs)
            if not env:
                continue
            reads.add(env.group(1))
            optional = re.match(r"(Option|Vec)<", ty) or ty == "bool" or re.search(r"\bdefault_values?(_t)?\b", attrs)
            if top_level and not optional:
                required.add(env.group(1))

    walk(root, True)
    for directory in closure:
        for path in rust_sources(directory):
            text = path.read_text()
            reads.update(re.findall(r'\benv::var(?:_os)?\(\s*"([A-Z0-9_]+)"\s*\)', text))
            if "from_default_env" in text:
                reads.add("RUST_LOG")  # tracing-subscriber's EnvFilter
    if any(d.name == "providers" for d in closure) and "FENCELINE_CATALOG" in reads:
        reads.update(catalog_auth_variables())
    return frozenset(reads), frozenset(required)


@functools.cache
def catalog_auth_variables():
    """The variables the deployed catalogue names for providers' `Authorization` values
    (read by shared/providers)."""
    catalog = json.loads((K8S / "catalog.json").read_text())
    return frozenset(p["auth_header_env"] for p in catalog["providers"].values() if p.get("auth_header_env"))


def clap_default(variable):
    """The documented default of a variable, from its clap attribute."""
    for path in (ROOT / "shared" / "config" / "src").glob("*.rs"):
        for attrs in re.findall(r"#\[arg\((.*?)\)\]", path.read_text(), re.S):
            if f'env = "{variable}"' in attrs:
                return re.search(r"default_value(?:_t)?\s*=\s*\"?([^\",)]+)", attrs).group(1).replace("_", "")
    raise AssertionError(f"no default for {variable}")


@functools.cache
def served_paths():
    """The paths every service answers (shared/runtime's health and metrics routes)."""
    text = "".join(path.read_text() for path in rust_sources(ROOT / "shared" / "runtime"))
    return frozenset(re.findall(r'\.route\("(/[^"]*)"', text))


@functools.cache
def topic_constants():
    text = (ROOT / "shared" / "events" / "src" / "topics.rs").read_text()
    return dict(re.findall(r'pub const (\w+): &str = "([^"]+)";', text))


@functools.cache
def consumer_groups(service):
    """(group, topic) pairs a service consumes: `app.consume(purpose, &[topics...])`, in the
    group `<prefix><service>.<purpose>` (shared/runtime) over `<prefix><topic>`."""
    crate = ROOT / "services" / service
    prefix = kafka_settings().get("FENCELINE_TOPIC_PREFIX", "")
    pairs = set()
    for path in rust_sources(crate):
        text = path.read_text()
        for purpose, topics in re.findall(r'\.consume\(\s*"([^"]+)",\s*&\[([^\]]*)\]', text):
            for constant in re.findall(r"topics::(\w+)", topics):
                pairs.add((f"{prefix}{service}.{purpose}", prefix + topic_constants()[constant]))
    return frozenset(pairs)


# --- the artefacts ---------------------------------------------------------------------


def read_env_file(path):
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


@functools.cache
def kustomization():
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def cache_dir():
    """Where the stack script installs the test's tools (FENCELINE_CACHE_DIR)."""
    return pathlib.Path(os.environ.get("FENCELINE_CACHE_DIR", pathlib.Path.home() / ".cache" / "fenceline"))


def kustomize_binary():
    built = cache_dir() / f"kustomize-{KUSTOMIZE_VERSION}" / "bin" / "kustomize"
    path = pathlib.Path(os.environ.get("FENCELINE_KUSTOMIZE", built))
    assert path.is_file(), f"kustomize is not installed at {path}: `deploy/local/stack test` builds it"
    return path


@functools.cache
def manifests():
    """Every object `kustomize build deploy/k8s` makes (what `kubectl apply -k` applies)
    and those of secrets.example.yaml, as (source, object)."""
    built = subprocess.run([str(kustomize_binary()), "build", str(K8S)], capture_output=True, text=True)
    assert built.returncode == 0, f"kustomize build deploy/k8s: {built.stderr}"
    objects = [("kustomize build", doc) for doc in yaml.safe_load_all(built.stdout) if doc]
    for doc in yaml.safe_load_all((K8S / "secrets.example.yaml").read_text()):
        objects.append(("secrets.example.yaml", doc))
    return objects


def config_maps():
    return {name: doc.get("data", {}) for name, doc in by_name("ConfigMap").items()}


def generated_config_map(generator):
    """The data of the ConfigMap a configMapGenerator made (its name carries a hash)."""
    found = [data for name, data in config_maps().items() if re.fullmatch(rf"{re.escape(generator)}-[a-z0-9]{{10}}", name)]
    assert len(found) == 1, f"kustomize made {len(found)} ConfigMaps from the generator {generator}"
    return found[0]


def kafka_settings():
    return generated_config_map("fenceline-kafka")


def of_kind(kind):
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def by_name(kind):
    return {doc["metadata"]["name"]: doc for doc in of_kind(kind)}


def secret_keys():
    return {name: set(doc.get("stringData", {})) | set(doc.get("data", {})) for name, doc in by_name("Secret").items()}


@functools.cache
def dockerfile_stages():
    """Stage name -> {"from": base, "lines": [instructions]} with continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if match:
            current = match.group(2) or f"stage{len(stages)}"
            stages[current] = {"from": match.group(1), "lines": []}
        elif current:
            stages[current]["lines"].append(line)
    return stages


def stage_chain(stage):
    """The stage and the stages it is built FROM, nearest first."""
    stages = dockerfile_stages()
    chain = []
    while stage in stages:
        chain.append(stages[stage])
        stage = stages[stage]["from"]
    return chain


def image_instruction(stage, instruction):
    """The instruction's arguments in effect for a stage (the nearest one wins)."""
    for s in stage_chain(stage):
        for line in reversed(s["lines"]):
            if line.upper().startswith(instruction + " "):
                return line[len(instruction) + 1 :].strip()
    return None


def image_env(stage):
    env = {}
    for s in reversed(stage_chain(stage)):
        for line in s["lines"]:
            if line.upper().startswith("ENV "):
                for token in shlex.split(line[4:]):
                    key, _, value = token.partition("=")
                    env[key] = value
    return env


def image_binaries(stage):
    """Binaries copied into /usr/local/bin by a stage and the stages below it."""
    build_outputs = set()
    for s in dockerfile_stages().values():
        for line in s["lines"]:
            build_outputs.update(re.findall(r"target/release/([\w-]+)", line))
    found = set()
    for s in stage_chain(stage):
        for line in s["lines"]:
            if line.upper().startswith("COPY ") and "--from=build" in line:
                sources = line.split()[1:-1]
                for source in sources:
                    if source.startswith("--"):
                        continue
                    name = pathlib.PurePath(source).name
                    found.update(build_outputs if source.endswith("/") else {name})
    return found


def final_stage():
    return list(dockerfile_stages())[-1]


def http_port(addr):
    return int(addr.rsplit(":", 1)[1])


# --- containers, from either artefact ---------------------------------------------------


def k8s_containers():
    """(deployment, container, environment, mounts) for every container and init container."""
    maps = config_maps()
    for deployment in of_kind("Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            env = dict(image_env(final_stage()))
            for source in container.get("envFrom", []):
                assert "configMapRef" in source, f"{container['name']}: only ConfigMaps are read whole"
                name = source["configMapRef"]["name"]
                assert name in maps, f"{deployment['metadata']['name']}/{container['name']}: no ConfigMap {name}"
                env.update(maps[name])
            for item in container.get("env", []):
                env[item["name"]] = item.get("value", item.get("valueFrom"))
            mounts = {}
            for mount in container.get("volumeMounts", []):
                volume = volumes[mount["name"]]
                if "secret" in volume:
                    keys = secret_keys().get(volume["secret"]["secretName"], set())
                else:
                    keys = set(maps.get(volume["configMap"]["name"], {}))
                mounts[mount["mountPath"]] = keys
            yield deployment, container, env, mounts


def compose_file():
    return yaml.safe_load(COMPOSE.read_text())


def compose_containers():
    """(name, service, environment, mounts) of every compose service run from Fenceline's image."""
    compose = compose_file()
    stage = None
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        stage = service["build"].get("target", final_stage())
        env = dict(image_env(stage))
        for env_file in service.get("env_file", []):
            env.update(read_env_file(COMPOSE.parent / env_file))
        env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
        mounts = {}
        for kind in ("configs", "secrets"):
            for item in service.get(kind, []):
                declared = compose[kind][item["source"]]["file"]
                source = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", declared)
                mounts[item["target"]] = (COMPOSE.parent / source, declared != source)
        yield name, service, env, mounts, stage


# --- the tests ----------------------------------------------------------------------------


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    checked = 0
    for source, doc in manifests():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problem = f"{source}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}"
            raise AssertionError(problem) from None
        checked += 1
    assert checked >= 20, f"only {checked} objects validated"


def keda_models_dir():
    return pathlib.Path(os.environ.get("FENCELINE_KEDA_MODELS", cache_dir() / f"keda-models-{KEDA_MODELS_VERSION}"))


KEDA_VALIDATE = """
const docs = JSON.parse(await new Promise((resolve) => {
  let text = ""; process.stdin.on("data", (c) => (text += c)); process.stdin.on("end", () => resolve(text));
}));
const errors = [];
for (const doc of docs) {
  const module = await import(`@kubernetes-models/keda/keda.sh/v1alpha1/${doc.kind}`);
  try { new module[doc.kind](doc).validate(); } catch (e) { errors.push(`${doc.kind}/${doc.metadata.name}: ${e.message}`); }
}
console.log(JSON.stringify(errors));
"""


def test_keda_objects_are_valid_against_kedas_schema():
    """KEDA's CRDs are not Kubernetes' own schemas: their validators come from the npm
    package @kubernetes-models/keda, installed by `deploy/local/stack test`."""
    docs = [doc for _, doc in manifests() if doc["apiVersion"].startswith("keda.sh/")]
    assert {d["kind"] for d in docs} == {"ScaledObject", "TriggerAuthentication"}
    models = keda_models_dir()
    assert (models / "node_modules" / "@kubernetes-models" / "keda").is_dir(), (
        f"KEDA's schemas are not installed in {models}: `deploy/local/stack test` installs them "
        "(npm ci of tests/python/keda-models)"
    )
    out = subprocess.run(
        ["node", "--input-type=module", "-e", KEDA_VALIDATE],
        cwd=models,
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out) == []
    # The schema leaves these optional; a ScaledObject without them scales nothing useful.
    for so in of_kind("ScaledObject"):
        for trigger in so["spec"]["triggers"]:
            if trigger["type"] == "kafka":
                assert {"bootstrapServers", "consumerGroup", "topic", "lagThreshold"} <= set(trigger["metadata"])


def test_the_kustomization_lists_every_file_and_only_existing_ones():
    listed = set(kustomization()["resources"])
    for generator in kustomization()["configMapGenerator"]:
        listed.update(generator.get("envs", []))
        listed.update(f.partition("=")[2] or f for f in generator.get("files", []))
    present = {p.name for p in K8S.iterdir()} - {"kustomization.yaml", "secrets.example.yaml"}
    assert listed == present
    images = {f"{i['newName']}:{i['newTag']}" for i in kustomization()["images"]}
    for deployment, container, _, _ in k8s_containers():
        assert container["image"] in images, f"{container['name']}: image {container['image']} is not the kustomization's"
    assert {d["metadata"].get("namespace") for _, d in manifests() if d["kind"] != "Namespace"} == {"fenceline"}


def check_environment(where, binary, env, stage):
    """What the artefact sets must be read by the binary; what the image sets (for every
    binary alike) must be read by every service."""
    reads, required = binary_variables(binary)
    image = image_env(stage)
    unknown = sorted(k for k in set(env) - reads if not (k in image and env[k] == image[k]))
    assert not unknown, f"{where}: {binary} reads no variable named {unknown}"
    for service in SERVICE_BINARIES:
        assert set(image) <= binary_variables(service)[0], f"the image sets a variable {service} does not read"
    missing = sorted(required - set(env))
    assert not missing, f"{where}: {binary} requires {missing}"


def file_variables(env):
    return {k: v for k, v in env.items() if isinstance(v, str) and (k.endswith(("_FILE", "_LOCATION")) or k == "FENCELINE_CATALOG")}


def test_every_container_sets_only_variables_its_binary_reads_and_all_it_requires():
    seen = set()
    for deployment, container, env, mounts in k8s_containers():
        where = f"{deployment['metadata']['name']}/{container['name']}"
        binary = container["command"][0]
        assert binary in image_binaries(final_stage()), f"{where}: {binary} is not in the image"
        check_environment(where, binary, env, final_stage())
        seen.add(binary)
        for variable, path in file_variables(env).items():
            directory, name = str(pathlib.PurePath(path).parent), pathlib.PurePath(path).name
            assert directory in mounts, f"{where}: {variable}={path} is on no mounted volume"
            assert name in mounts[directory], f"{where}: the volume at {directory} has no key {name} ({variable})"
        for item in container.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secret_keys().get(ref["name"], set()), f"{where}: no Secret {ref['name']}/{ref['key']}"
    assert seen == set(SERVICE_BINARIES) | {ADMIN_BINARY}


def test_intake_accepts_only_kinds_the_catalogue_declares():
    catalog = json.loads((K8S / "catalog.json").read_text())
    for deployment, container, env, _ in k8s_containers():
        if container["command"][0] == "fenceline-intake":
            kinds = set(env["FENCELINE_INTAKE_KINDS"].split(","))
            assert kinds <= set(catalog["kinds"]), f"intake accepts {sorted(kinds - set(catalog['kinds']))}, which nothing runs"


def test_ports_and_probes_are_the_ones_the_services_serve():
    for deployment, container, env, _ in k8s_containers():
        if container["command"][0] not in SERVICE_BINARIES:
            continue
        where = deployment["metadata"]["name"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": http_port(env["FENCELINE_HTTP_ADDR"])}, where
        assert env["FENCELINE_HTTP_ADDR"].startswith(("0.0.0.0:", "[::]:")), f"{where}: listens on loopback only"
        for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = container[probe]["httpGet"]
            assert get["path"] == path and path in served_paths(), f"{where}: {probe} on {get['path']}"
            assert get["port"] in ports or get["port"] in ports.values(), f"{where}: {probe} port {get['port']}"
        # Prometheus is pointed at the metrics page on the service's port.
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", f"{where}: not scraped"
        assert annotations.get("prometheus.io/path") in served_paths() - {"/healthz", "/readyz"}, where
        assert int(annotations.get("prometheus.io/port", 0)) in ports.values(), f"{where}: metrics port"
        # The start-up probe outlasts the wait for the brokers.
        startup = container["startupProbe"]
        connect_ms = int(env.get("FENCELINE_KAFKA_CONNECT_TIMEOUT_MS", clap_default("FENCELINE_KAFKA_CONNECT_TIMEOUT_MS")))
        assert startup["periodSeconds"] * startup["failureThreshold"] > connect_ms / 1000 + 10, where


def test_pods_get_longer_than_the_drain_and_the_drain_ends_before_the_session():
    for deployment, container, env, _ in k8s_containers():
        if container["command"][0] not in SERVICE_BINARIES:
            continue
        where = deployment["metadata"]["name"]
        grace_ms = int(env.get("FENCELINE_SHUTDOWN_GRACE_MS", clap_default("FENCELINE_SHUTDOWN_GRACE_MS")))
        session_ms = int(env.get("FENCELINE_KAFKA_SESSION_TIMEOUT_MS", clap_default("FENCELINE_KAFKA_SESSION_TIMEOUT_MS")))
        assert grace_ms < session_ms, f"{where}: the service refuses a grace not shorter than the session timeout"
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pause = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
        # shared/runtime: the HTTP server's graceful stop, then the background work, each
        # up to the grace, then at least one second for the relay's last round.
        drain = pause + 2 * grace_ms / 1000 + 1
        period = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert period > drain, f"{where}: {period} s is not longer than the drain ({drain} s)"


def test_services_budgets_and_scalers_select_the_deployments():
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in of_kind("Deployment")}

    def selects(selector, labels):
        return all(labels.get(k) == v for k, v in selector.items())

    for deployment in of_kind("Deployment"):
        assert selects(deployment["spec"]["selector"]["matchLabels"], pods[deployment["metadata"]["name"]])
    for service in of_kind("Service"):
        chosen = [n for n, labels in pods.items() if selects(service["spec"]["selector"], labels)]
        assert chosen == [service["metadata"]["name"]], service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            assert port["targetPort"] == "http"
    budgets = {b["metadata"]["name"]: b for b in of_kind("PodDisruptionBudget")}
    assert set(budgets) == set(pods), "a PodDisruptionBudget per service"
    for name, budget in budgets.items():
        assert [n for n, l in pods.items() if selects(budget["spec"]["selector"]["matchLabels"], l)] == [name]


def test_every_consuming_service_scales_on_the_lag_of_its_real_groups():
    scalers = {so["spec"]["scaleTargetRef"]["name"]: so for so in of_kind("ScaledObject")}
    deployments = by_name("Deployment")
    auths = by_name("TriggerAuthentication")
    partitions = int(generated_config_map("fenceline-topics")["FENCELINE_PARTITIONS"])
    for name, deployment in deployments.items():
        service = SERVICE_BINARIES[deployment["spec"]["template"]["spec"]["containers"][0]["command"][0]]
        groups = consumer_groups(service)
        assert groups, f"{service} consumes nothing?"
        assert name in scalers, f"{name} consumes {sorted(groups)} but has no ScaledObject"
        so = scalers[name]
        assert "replicas" not in deployment["spec"], f"{name}: replicas belong to the ScaledObject's HPA"
        kafka = [t for t in so["spec"]["triggers"] if t["type"] == "kafka"]
        scaled = {(t["metadata"]["consumerGroup"], t["metadata"]["topic"]) for t in kafka}
        assert scaled == groups, f"{name} scales on {sorted(scaled - groups)}, not on {sorted(groups - scaled)}"
        for trigger in kafka:
            assert trigger["metadata"]["bootstrapServers"] == kafka_settings()["FENCELINE_KAFKA_BROKERS"]
            assert trigger["metadata"]["offsetResetPolicy"] == "earliest", "the consumers start at the earliest"
        assert 2 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"] <= partitions, name
        for trigger in so["spec"]["triggers"]:
            ref = trigger.get("authenticationRef", {}).get("name")
            if ref:
                assert ref in auths, f"{name}: no TriggerAuthentication {ref}"
            if trigger["type"] == "postgresql":
                table = re.search(r"FROM (\w+)\.(\w+)", trigger["metadata"]["query"])
                schema, relation = table.groups()
                assert schema == service, "the service's own schema (FENCELINE_DATABASE_SCHEMA's default)"
                migrations = "".join(p.read_text() for p in (ROOT / "services" / service / "migrations").glob("*.sql"))
                assert f"CREATE TABLE {relation} " in migrations, f"no table {relation} in {service}'s migrations"
    for auth in auths.values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in secret_keys().get(ref["name"], set()), f"no Secret {ref['name']}/{ref['key']}"


def test_only_intake_takes_traffic_from_outside_the_namespace():
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in of_kind("Deployment")}
    policies = of_kind("NetworkPolicy")
    assert any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies), "a default deny"
    for policy in policies:
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        chosen = {n for n, labels in pods.items() if all(labels.get(k) == v for k, v in selector.items())}
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            outside = peers is None or any("ipBlock" in p or p.get("namespaceSelector") == {} for p in peers)
            monitoring = peers and all(
                p.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "monitoring"}
                for p in peers
            )
            namespace = peers and all(set(p) == {"podSelector"} for p in peers)
            assert outside or monitoring or namespace, f"{policy['metadata']['name']}: a rule of unknown reach"
            if outside:
                assert chosen == {"intake"}, f"{policy['metadata']['name']} opens {sorted(chosen)} to outside"
            assert all(p["port"] == "http" for p in rule["ports"]), "only the HTTP port"


def test_the_compose_file_is_valid_against_the_compose_specification():
    """The Compose Specification's schema, as check-jsonschema ships it."""
    checked = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_compose_file_runs_the_same_image_with_variables_the_binaries_read():
    compose = compose_file()
    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:")
    assert compose["services"]["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert compose["services"]["postgres"]["image"].startswith("postgres:15")
    seen = set()
    for name, service, env, mounts, stage in compose_containers():
        binary = service["command"][0]
        assert binary in image_binaries(stage), f"compose {name}: {binary} is not in the {stage} image"
        check_environment(f"compose {name}", binary, env, stage)
        seen.add(binary)
        for variable, path in file_variables(env).items():
            assert path in mounts, f"compose {name}: {variable}={path} is mounted from nothing"
            source, overridable = mounts[path]
            assert source.exists() or overridable, f"compose {name}: {source} does not exist"
        if binary in SERVICE_BINARIES:
            port = http_port(env["FENCELINE_HTTP_ADDR"])
            for mapping in service.get("ports", []):
                assert mapping.rsplit(":", 1)[1] == str(port), f"compose {name}: {mapping} is not port {port}"
            grace_s = int(env.get("FENCELINE_SHUTDOWN_GRACE_MS", clap_default("FENCELINE_SHUTDOWN_GRACE_MS"))) / 1000
            assert int(service["stop_grace_period"].rstrip("s")) > 2 * grace_s + 1, f"compose {name}: stop grace"
            assert service["depends_on"]["ensure-topics"]["condition"] == "service_completed_successfully"
    assert seen == set(SERVICE_BINARIES) | {ADMIN_BINARY}


def test_the_dockerfile_builds_workspace_binaries_into_a_non_root_image_with_a_real_health_check():
    binaries = workspace_binaries()
    final = final_stage()
    shipped = image_binaries(final)
    assert set(SERVICE_BINARIES) | {ADMIN_BINARY} <= shipped
    for binary in shipped:
        assert binary in binaries, f"the image ships {binary}, which no workspace package builds"
    built = {p for line in dockerfile_stages()["build"]["lines"] for p in re.findall(r"-p\s+([\w-]+)", line)}
    assert {binaries[b][0] for b in shipped} <= built, "a shipped binary whose package is not built"
    user = image_instruction(final, "USER")
    assert user and user.split(":")[0] not in ("root", "0"), f"the image runs as {user}"
    env = image_env(final)
    health = image_instruction(final, "HEALTHCHECK")
    path = re.search(r"http://127\.0\.0\.1:[^/]+(/\S*?)\"", health).group(1)
    assert path in served_paths(), f"the health check asks {path}"
    assert "FENCELINE_HTTP_ADDR##*:" in health, "the health check follows the listener's port"
    assert image_instruction(final, "EXPOSE") == str(http_port(env["FENCELINE_HTTP_ADDR"]))
    ignored = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert {"target", ".git"} <= set(ignored)
    needed = [pathlib.Path(p["manifest_path"]).parent.relative_to(ROOT) for p in cargo_metadata()["packages"]]
    for directory in needed + [pathlib.Path("schemas")]:
        for pattern in ignored:
            assert not str(directory).startswith(pattern.rstrip("/") + "/") and str(directory) != pattern, (
                f".dockerignore's {pattern} leaves {directory} out of the build"
            )
