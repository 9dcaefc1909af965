# The step runner of scripts/install.sh (sourced; tests/unit/test_install_output.py tests it).
#
#   steps_begin                                  empties the log, starts the clock
#   step LABEL [--skip-if CHECK] COMMAND [ARG...]
#   steps_end MESSAGE                            the last line: MESSAGE, total time, the log's path
#
# step runs COMMAND (a program or a shell function) in a subshell under `set -e`, unless CHECK
# (one word: a program or a function) succeeds, and prints one line with its wall time:
#   [install] LABEL ... done (93.4 s)        or        [install] LABEL ... present (0.0 s)
# "[install] LABEL ... " is printed when the step starts, so a long step shows what it is doing.
# The output of COMMAND and CHECK goes to $INSTALL_LOG (default results/install.log, git-ignored);
# with VERBOSE=1 (anything but empty or 0) COMMAND's output is also streamed as it runs.
# If COMMAND fails, step prints its whole output and the log's path to stderr and exits with
# its status. Don't call step inside a condition (`if step ...`, `step ... || ...`): bash
# would then ignore `set -e` within the step's command.

: "${INSTALL_LOG:=results/install.log}"

_step_usec() { echo "${EPOCHREALTIME/[.,]/}"; }          # wall clock in microseconds (bash >= 5)
_step_secs() {                                              # microseconds -> "0.3 s", "93.4 s", "412 s"
    local ds=$((($1 + 50000) / 100000))
    if ((ds < 1000)); then printf '%d.%d s' $((ds / 10)) $((ds % 10)); else printf '%d s' $((ds / 10)); fi
}
_step_say() {                                               # "[install] TEXT" (bold on a terminal), no newline
    if [ -t 1 ]; then printf '\033[1m[install]\033[0m %s' "$*"; else printf '[install] %s' "$*"; fi
}
_step_verbose() { case ${VERBOSE:-0} in '' | 0) return 1 ;; esac; }

steps_begin() {
    mkdir -p "$(dirname "$INSTALL_LOG")"
    printf '# %s, %s\n' "$0" "$(date)" >"$INSTALL_LOG"
    _STEPS_START=$(_step_usec)
}

steps_end() {
    _step_say "$* (total $(_step_secs $(($(_step_usec) - ${_STEPS_START:-$(_step_usec)}))); full log: $INSTALL_LOG)"
    echo
}

step() {
    local label=$1 check='' rc=0 result=done errexit=''
    shift
    if [ "${1-}" = --skip-if ]; then check=$2; shift 2; fi
    (($#)) || { echo "step: no command for \"$label\"" >&2; exit 2; }
    mkdir -p "$(dirname "$INSTALL_LOG")"
    printf '\n==== %s\n' "$label" >>"$INSTALL_LOG"
    local offset start
    start=$(_step_usec)
    if _step_verbose; then _step_say "$label ..."; echo; else _step_say "$label ... "; fi

    # the subshell is not in a condition, so its `set -e` holds; set +e here only to keep its status
    [[ $- == *e* ]] && errexit=1
    set +e
    if [ -n "$check" ] && "$check" >>"$INSTALL_LOG" 2>&1 </dev/null; then
        result=present
    else
        printf -- '---- running: %s\n' "$*" >>"$INSTALL_LOG"
        offset=$(stat -c %s "$INSTALL_LOG")    # a failure shows the log from here on
        if _step_verbose; then
            (set -e; "$@") 2>&1 | tee -a "$INSTALL_LOG"
            rc=${PIPESTATUS[0]}
        else
            (set -e; "$@") >>"$INSTALL_LOG" 2>&1 </dev/null
            rc=$?
        fi
    fi
    if [ -n "$errexit" ]; then set -e; fi

    local took
    took=$(_step_secs $(($(_step_usec) - start)))
    if ((rc == 0)); then result="$result ($took)"; else result="FAILED (exit status $rc, $took)"; fi
    if _step_verbose; then _step_say "$label ... $result"; echo; else echo "$result"; fi
    if ((rc == 0)); then
        printf '==== %s: %s\n' "$label" "$result" >>"$INSTALL_LOG"
        return 0
    fi
    {
        if ! _step_verbose; then   # (streamed already otherwise)
            echo "---- output of \"$label\" ----"
            tail -c +$((offset + 1)) "$INSTALL_LOG"
            echo "---- end of output ----"
        fi
        _step_say "error: \"$label\" failed with exit status $rc; full log: $INSTALL_LOG"
        echo
    } >&2
    printf '==== %s: %s\n' "$label" "$result" >>"$INSTALL_LOG"
    exit "$rc"
}
