# Sourced by the launch scripts. wait_launcher PID [train flags...]: wait for the launcher
# started in the background as PID, then set `code` to what the run recorded (RUN/exit.json,
# read by launch/exit_code.py) or, without a record of this launch, the launcher's own code.
# Uses the caller's $venv and $record.
wait_launcher() {
  local child=$1
  shift
  code=0
  wait "$child" || code=$?
  while kill -0 "$child" 2>/dev/null; do  # a trapped signal ends `wait` early
    code=0
    wait "$child" || code=$?
  done
  code=$("$venv/bin/python" -m launch.exit_code "$code" "$record" "$@") || code=1
}
