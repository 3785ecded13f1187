# Two commands matter (see README): `make train` (main job) and `make test` (the suite CI runs).
# Both install whatever is missing first; re-running them skips finished steps.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DATA    := data/bible-es-en
SWORD   := /usr/share/sword/mods.d/spaRV1909eb.conf /usr/share/sword/mods.d/engWEB2015eb.conf
WORKERS ?= 2

.PHONY: install sword corpus train test lint bench clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU machines: pin the local CPU wheel first so no multi-GB CUDA build is pulled.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[bible,test,triton,bench,serve,tensorboard]'
	touch $@

install: $(STAMP)

$(SWORD):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sword-text-sparv sword-text-web

sword: $(SWORD)

$(DATA)/train.es: nmt/data/bible.py | $(STAMP) $(SWORD)
	$(BIN)/nmt-data bible --out $(DATA)

corpus: $(DATA)/train.es

# Main job: build the embedded corpus, train with $(WORKERS) local workers exchanging dense
# gradients (bounded to ~15 minutes on 2 CPU cores), validate with sacreBLEU, translate held-out lines.
train: corpus
	$(BIN)/nmt-train --config recipes/bible-es-en.yml --workers $(WORKERS)
	head -n 5 $(DATA)/test.es | $(BIN)/nmt-translate --model models/bible-es-en

test: $(STAMP) $(SWORD)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/kernels.py

clean:
	rm -rf $(VENV) build *.egg-info
