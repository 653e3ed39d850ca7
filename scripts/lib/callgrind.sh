# Sourced by the callgrind benchmark scripts.
#
# need COMMAND PACKAGE: installs the Debian PACKAGE when COMMAND is missing (with sudo when not
# root).
need() {
    command -v "$1" >/dev/null || {
        local sudo=""
        [ "$(id -u)" -ne 0 ] && sudo=sudo
        $sudo apt-get install -y -qq "$2" >/dev/null
    }
}

# callgrind_total FILE: the instructions of a callgrind output, in all.
callgrind_total() {
    callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'
}
