# The two commands of the README. Each installs what it needs first.
.PHONY: up test test-all test-slow install

up:        ## bring up redis + 1 prefill + 1 decode worker + gateway on :50051, answer a sample request, keep serving
	scripts/install.sh
	.venv/bin/pdserve up --prefill 1 --decode 1 --port 50051

test:      ## the default (fast) test suite
	scripts/install.sh test
	.venv/bin/python -m pytest -q

test-slow: ## tests marked slow (token-exactness sweeps, long integration runs)
	scripts/install.sh test
	.venv/bin/python -m pytest -q -m slow $(PYTEST_ARGS)

install:
	scripts/install.sh test
