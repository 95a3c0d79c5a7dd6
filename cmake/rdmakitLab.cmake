# rdmakit_add_rxe_test(NAME name [VMS n] [NICS n] [TIMEOUT sec] [ALONE] COMMAND cmd args...)
#
# Registers a CTest test, labelled `rxe`, that boots n lab VMs (lab/rdmakit-lab) and runs the
# command in each of them (it reads RDMAKIT_LAB_INDEX to pick its role), each VM with n NICs
# (lab --nics). The command's timeout is
# enforced inside the lab; CTest's own TIMEOUT is a backstop that adds room for booting.
# rxe tests run one at a time and alone (RUN_SERIAL): their VMs take host cores, and the guests'
# timing checks (a p99 against a baseline, a stall bound) see any host work that shares them.
# (Tried: tests without a VM beside a one-VM suite, all on the same cores. The suites ran 20-45%
# longer, the background builds starved, a guest's p99 check and a host test's rate check failed.)
# With RDMAKIT_TEST_CPUS on, each test instead takes a host CPU of its own from ctest
# (RESOURCE_GROUPS "cpus:1"; ctest runs with a resource spec file that lists the CPUs, as
# scripts/test does) and is held there by tests/on_cpu.sh: a one-VM suite runs its VM on it at one
# vCPU, a test without a VM runs on it. So two one-VM suites, or a suite and the tests without a
# VM, run side by side on two CPUs without sharing either. One-VM suites start first (COST).
# Suites of several VMs, those marked ALONE (whose point is two threads on two vCPUs at once), and
# host tests that need threads on two cores at once still run alone on every CPU (RUN_SERIAL).
# Measured: a one-VM suite at one vCPU on a core of its own ran 0-25% longer than at two vCPUs
# shared (rxe.library 280 s against 273-312; rxe.tools 192 s against 151).
set(RDMAKIT_LAB ${CMAKE_CURRENT_LIST_DIR}/../lab/rdmakit-lab)
option(RDMAKIT_TEST_CPUS
       "Each test takes a host CPU of its own from ctest (run ctest with a resource spec file listing the CPUs: scripts/test); one-VM lab suites at one vCPU on it" OFF)
# The prefix of a test's command that holds it to its CPU, and of one whose peer processes listen
# on fixed ports (a network namespace of its own where this configure could make one: root with
# CAP_SYS_ADMIN; elsewhere such tests share a RESOURCE_LOCK, RDMAKIT_FIXED_PORTS, and run one at
# a time). A tree configured so runs its tests as the user who configured it.
set(RDMAKIT_ON_CPU)
set(RDMAKIT_ON_CPU_OWN_NETWORK)
set(RDMAKIT_FIXED_PORTS RESOURCE_LOCK host_ports)
if(RDMAKIT_TEST_CPUS)
  set(RDMAKIT_ON_CPU sh ${PROJECT_SOURCE_DIR}/tests/on_cpu.sh)
  set(RDMAKIT_ON_CPU_OWN_NETWORK ${RDMAKIT_ON_CPU})
  execute_process(COMMAND unshare --net sh -c "ip link set lo up" RESULT_VARIABLE own_network
                  OUTPUT_QUIET ERROR_QUIET)
  if(own_network EQUAL 0)
    list(APPEND RDMAKIT_ON_CPU_OWN_NETWORK --own-network)
    set(RDMAKIT_FIXED_PORTS)
    message(STATUS "rdmakit: tests with fixed ports each in a network namespace of their own")
  else()
    message(STATUS "rdmakit: no network namespace here (unshare --net): tests with fixed ports run one at a time")
  endif()
endif()

# rdmakit_add_test_on_cpu(NAME name [OWN_NETWORK] COMMAND cmd args... [WORKING_DIRECTORY dir]):
# add_test, with the test held to a CPU of its own where each test takes one (RDMAKIT_TEST_CPUS):
# its command through tests/on_cpu.sh and its RESOURCE_GROUPS "cpus:1", which go together
# (scripts/test refuses a tree where a test has one without the other). OWN_NETWORK: a test whose
# peer processes listen on fixed ports, in a network namespace of its own where there can be one,
# else holding RDMAKIT_FIXED_PORTS (one such test at a time). The other properties are the
# caller's (set_tests_properties: a list-valued one, ENVIRONMENT, would not pass through this
# function unsplit).
function(rdmakit_add_test_on_cpu)
  cmake_parse_arguments(ARG "OWN_NETWORK" "NAME;WORKING_DIRECTORY" "COMMAND" ${ARGN})
  # (A keyword misspelled after COMMAND is one of the command's arguments: nothing can tell.)
  list(LENGTH ARG_COMMAND command_words)
  if(NOT ARG_NAME OR command_words EQUAL 0 OR ARG_UNPARSED_ARGUMENTS OR ARG_KEYWORDS_MISSING_VALUES)
    message(FATAL_ERROR "rdmakit_add_test_on_cpu(${ARGN}): takes NAME name [OWN_NETWORK] COMMAND cmd args... "
                        "[WORKING_DIRECTORY dir] (not taken: '${ARG_UNPARSED_ARGUMENTS}'; without a value: "
                        "'${ARG_KEYWORDS_MISSING_VALUES}')")
  endif()
  set(prefix ${RDMAKIT_ON_CPU})
  if(ARG_OWN_NETWORK)
    set(prefix ${RDMAKIT_ON_CPU_OWN_NETWORK})
  endif()
  set(dir)
  if(ARG_WORKING_DIRECTORY)
    set(dir WORKING_DIRECTORY ${ARG_WORKING_DIRECTORY})
  endif()
  add_test(NAME ${ARG_NAME} COMMAND ${prefix} ${ARG_COMMAND} ${dir})
  if(RDMAKIT_TEST_CPUS)
    set_tests_properties(${ARG_NAME} PROPERTIES RESOURCE_GROUPS "cpus:1")
  endif()
  if(ARG_OWN_NETWORK AND RDMAKIT_FIXED_PORTS)
    set_tests_properties(${ARG_NAME} PROPERTIES ${RDMAKIT_FIXED_PORTS})
  endif()
endfunction()

function(rdmakit_add_rxe_test)
  cmake_parse_arguments(ARG "ALONE" "NAME;VMS;NICS;TIMEOUT" "COMMAND" ${ARGN})
  if(NOT ARG_VMS)
    set(ARG_VMS 1)
  endif()
  if(NOT ARG_NICS)
    set(ARG_NICS 1)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  math(EXPR backstop "${ARG_TIMEOUT} + 240")
  # The lab's working directory is its one writable share, and the guests see it uncached (they
  # exchange files through it), so every exec of a binary in it reads the whole file over 9p
  # again: about a second for a 60 MB sanitized test binary. So it is an empty directory of its
  # own; the binaries come through the read-only, page-cached --share of the build tree.
  set(work ${CMAKE_CURRENT_BINARY_DIR}/lab-work/${ARG_NAME})
  file(MAKE_DIRECTORY ${work})
  # The guest's stdout is a terminal (virtio console): keep GoogleTest's output plain. The source
  # and build trees may live below /tmp, which the guest replaces with its own.
  set(command env GTEST_COLOR=no ${RDMAKIT_LAB} run --vms ${ARG_VMS} --nics ${ARG_NICS} --timeout ${ARG_TIMEOUT}
              --share ${PROJECT_SOURCE_DIR} --share ${PROJECT_BINARY_DIR} -- ${ARG_COMMAND})
  if(RDMAKIT_TEST_CPUS AND ARG_VMS EQUAL 1 AND NOT ARG_ALONE)
    rdmakit_add_test_on_cpu(NAME rxe.${ARG_NAME} COMMAND ${command} WORKING_DIRECTORY ${work})
    set(alone COST 100000)
  else()
    add_test(NAME rxe.${ARG_NAME} COMMAND ${command} WORKING_DIRECTORY ${work})
    set(alone RUN_SERIAL TRUE)
  endif()
  set_tests_properties(rxe.${ARG_NAME} PROPERTIES
    LABELS rxe TIMEOUT ${backstop} ${alone})
endfunction()

# rdmakit_add_rxe_suite(NAME name [VMS n] [NICS n] [ALONE] CASES case timeout "command" [case timeout "command"...])
#
# Many cases in one lab boot (tests/rxe/suite.sh runs them in turn and reports each, with its
# wall time): a boot costs seconds, so cases that can share one do. Commands may use generator
# expressions ($<TARGET_FILE:...>); each case's timeout is enforced inside the guest, the
# suite's lab timeout is their sum.
function(rdmakit_add_rxe_suite)
  cmake_parse_arguments(ARG "ALONE" "NAME;VMS;NICS" "CASES" ${ARGN})
  list(LENGTH ARG_CASES n)
  math(EXPR rem "${n} % 3")
  if(n EQUAL 0 OR NOT rem EQUAL 0)
    message(FATAL_ERROR "rdmakit_add_rxe_suite(${ARG_NAME}): CASES takes triples: name timeout command")
  endif()
  set(content "")
  set(total 30)
  math(EXPR last "${n} - 1")
  foreach(i RANGE 0 ${last} 3)
    math(EXPR t "${i} + 1")
    math(EXPR c "${i} + 2")
    list(GET ARG_CASES ${i} case_name)
    list(GET ARG_CASES ${t} case_timeout)
    list(GET ARG_CASES ${c} case_command)
    string(APPEND content "${case_name}\t${case_timeout}\t${case_command}\n")
    math(EXPR total "${total} + ${case_timeout}")
  endforeach()
  set(file ${CMAKE_CURRENT_BINARY_DIR}/suites/${ARG_NAME}.cases)
  file(GENERATE OUTPUT ${file} CONTENT "${content}")
  set(alone)
  if(ARG_ALONE)
    set(alone ALONE)
  endif()
  rdmakit_add_rxe_test(NAME ${ARG_NAME} VMS ${ARG_VMS} NICS ${ARG_NICS} TIMEOUT ${total} ${alone}
                       COMMAND sh ${PROJECT_SOURCE_DIR}/tests/rxe/suite.sh ${file})
endfunction()
